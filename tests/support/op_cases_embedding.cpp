// Op-table cases for embedding (repeated ids: the scatter-add backward), index_select_rows,
// splice_rows, concat and split.
#include <algorithm>
#include <numeric>

#include "kestrel/ops/embedding.h"
#include "kestrel/ops/elementwise.h"
#include "support/op_table.h"

namespace kestrel::testing {
namespace {

// n ids in [0, v) with repeats (i * 7 + k) % v, shuffled by a fixed stride.
std::vector<int64_t> ids_with_repeats(int64_t n, int64_t v) {
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < n; ++i) ids.push_back((i * 7 + 3 + (i % 3) * 11) % v);
  return ids;
}

// Row gather reference: x [N, ...] rows at idx.
Tensor rows_reference(const Tensor& x, const std::vector<int64_t>& idx, Shape out_shape) {
  int64_t R = x.numel() / x.shape()[0];
  std::vector<double> xv = host_values(x), o;
  for (int64_t i : idx) o.insert(o.end(), xv.begin() + i * R, xv.begin() + (i + 1) * R);
  return f64_tensor(o, out_shape);
}

}  // namespace

void add_embedding_cases(std::vector<OpCase>& cases) {
  struct ESpec {
    const char* cls;
    int64_t V, C;
    Shape ids;
    DType id_dtype;
    bool grad;
  };
  const ESpec especs[] = {
      {"v1_c1_ids1", 1, 1, {1}, DType::I64, true},
      {"v7_c5_ids2x9", 7, 5, {2, 9}, DType::I32, true},
      {"v1000_c7_ids127", 1000, 7, {127}, DType::I64, false},
      {"v127_c1000_ids1000", 127, 1000, {1000}, DType::I32, false},
  };
  for (const ESpec& sp : especs) {
    OpCase c;
    c.name = "embedding";
    c.shape_class = sp.cls;
    c.make_inputs = [sp](DType dt, Device dev) -> OpInputs {
      return {randn({sp.V, sp.C}, dt, dev), index_tensor(ids_with_repeats(numel(sp.ids), sp.V), sp.ids, sp.id_dtype, dev)};
    };
    c.op = [](const OpInputs& in) -> std::vector<Tensor> { return {embedding(in[0], in[1], true)}; };
    c.reference = [](const OpInputs& in) -> std::vector<Tensor> {
      Shape s = in[1].shape();
      s.push_back(in[0].shape()[1]);
      return {rows_reference(in[0], in[1].to_int_vector(), s)};
    };
    c.gradcheck = sp.grad;
    c.tol = OpTolerance{0, 0, 0, 0};  // a copy: exact
    cases.push_back(c);
  }
  for (auto [cls, xs, m, grad] : std::vector<std::tuple<const char*, Shape, int64_t, bool>>{
           {"x9x3x2_idx5", {9, 3, 2}, 5, true}, {"x1_idx1", {1}, 1, true}, {"x127x1000_idx33", {127, 1000}, 33, false}}) {
    OpCase c;
    c.name = "index_select_rows";
    c.shape_class = cls;
    c.make_inputs = [xs = xs, m = m](DType dt, Device dev) -> OpInputs {
      return {randn(xs, dt, dev), index_tensor(ids_with_repeats(m, xs[0]), {m}, DType::I64, dev)};
    };
    c.op = [](const OpInputs& in) -> std::vector<Tensor> { return {index_select_rows(in[0], in[1])}; };
    c.reference = [](const OpInputs& in) -> std::vector<Tensor> {
      Shape s = in[0].shape();
      s[0] = in[1].numel();
      return {rows_reference(in[0], in[1].to_int_vector(), s)};
    };
    c.gradcheck = grad;
    c.tol = OpTolerance{0, 0, 0, 0};
    cases.push_back(c);
  }
  // splice_rows: image embeddings written at image-token slots.
  for (auto [cls, n, ccols, slots, grad] : std::vector<std::tuple<const char*, int64_t, int64_t, std::vector<int64_t>, bool>>{
           {"n11_c6_slots4", 11, 6, {7, 0, 3, 10}, true},
           {"n1_c1_slots1", 1, 1, {0}, true},
           {"n7_c3_noslots", 7, 3, {}, true},
           {"n1000_c127_slots256", 1000, 127, {}, false}}) {
    std::vector<int64_t> idx = slots;
    if (n == 1000)
      for (int64_t i = 0; i < 256; ++i) idx.push_back(100 + i * 3);
    OpCase c;
    c.name = "splice_rows";
    c.shape_class = cls;
    c.make_inputs = [n = n, cc = ccols, idx](DType dt, Device dev) -> OpInputs {
      int64_t m = static_cast<int64_t>(idx.size());
      return {randn({n, cc}, dt, dev), index_tensor(idx, {m}, DType::I64, dev), randn({m, cc}, dt, dev)};
    };
    c.op = [](const OpInputs& in) -> std::vector<Tensor> { return {splice_rows(in[0], in[1], in[2])}; };
    c.reference = [](const OpInputs& in) -> std::vector<Tensor> {
      std::vector<double> b = host_values(in[0]), s = host_values(in[2]);
      std::vector<int64_t> ix = in[1].to_int_vector();
      int64_t C = in[0].shape()[1];
      for (size_t m = 0; m < ix.size(); ++m)
        std::copy(s.begin() + m * C, s.begin() + (m + 1) * C, b.begin() + ix[m] * C);
      return {f64_tensor(b, in[0].shape())};
    };
    c.gradcheck = grad;
    c.tol = OpTolerance{0, 0, 0, 0};
    cases.push_back(c);
  }
  // concat along each dim of three parts, and split back (multiple outputs).
  for (int64_t dim : {0, 1, -1}) {
    OpCase c;
    c.name = "concat";
    c.shape_class = "three_parts_dim" + std::to_string(dim < 0 ? 2 : dim);
    Shape a{2, 3, 4}, b{2, 3, 4}, d{2, 3, 4};
    int64_t dd = dim < 0 ? 2 : dim;
    b[dd] = 1;
    d[dd] = 5;
    c.make_inputs = [a, b, d](DType dt, Device dev) -> OpInputs {
      return {randn(a, dt, dev), randn(b, dt, dev), randn(d, dt, dev)};
    };
    c.op = [dim](const OpInputs& in) -> std::vector<Tensor> { return {concat({in[0], in[1], in[2]}, dim)}; };
    c.reference = [dd](const OpInputs& in) -> std::vector<Tensor> {
      Shape out = in[0].shape();
      out[dd] = in[0].shape()[dd] + in[1].shape()[dd] + in[2].shape()[dd];
      std::vector<std::vector<double>> parts{host_values(in[0]), host_values(in[1]), host_values(in[2])};
      std::vector<double> o(static_cast<size_t>(numel(out)));
      for (int64_t i = 0; i < numel(out); ++i) {
        auto idx = unravel(i, out);
        int k = 0;
        while (idx[dd] >= in[k].shape()[dd]) idx[dd] -= in[k++].shape()[dd];
        o[i] = parts[k][ravel(idx, in[k].shape())];
      }
      return {f64_tensor(o, out)};
    };
    c.gradcheck = true;
    c.tol = OpTolerance{0, 0, 0, 0};
    cases.push_back(c);

    OpCase s;
    s.name = "split";
    s.shape_class = "2x3x10_sizes_3_0_7_dim" + std::to_string(dd);
    Shape xs{2, 3, 4};
    xs[dd] = 10;
    std::vector<int64_t> sizes{3, 0, 7};
    s.make_inputs = [xs](DType dt, Device dev) -> OpInputs { return {randn(xs, dt, dev)}; };
    // Scale each part differently so the gradient routing is visible.
    s.op = [sizes, dim](const OpInputs& in) -> std::vector<Tensor> {
      auto parts = split(in[0], sizes, dim);
      return {scale(parts[0], 2.0), parts[1], scale(parts[2], -3.0)};
    };
    s.reference = [sizes, dd](const OpInputs& in) -> std::vector<Tensor> {
      std::vector<Tensor> outs;
      int64_t off = 0;
      double factors[] = {2.0, 1.0, -3.0};
      for (size_t k = 0; k < sizes.size(); ++k) {
        Shape ps = in[0].shape();
        ps[dd] = sizes[k];
        Tensor p = gather_reference(in[0], ps, [&](const std::vector<int64_t>& oi) {
          auto ii = oi;
          ii[dd] += off;
          return ravel(ii, in[0].shape());
        });
        std::vector<double> v = host_values(p);
        for (double& x : v) x *= factors[k];
        outs.push_back(f64_tensor(v, ps));
        off += sizes[k];
      }
      return outs;
    };
    s.gradcheck = true;
    cases.push_back(s);
  }
}

}  // namespace kestrel::testing
