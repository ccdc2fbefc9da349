// Op-table cases for shape ops (views and copies): reshape, permute, transpose, narrow, (un)squeeze,
// expand, contiguous and cast. References map each output element to its source element.
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/shape.h"
#include "support/op_table.h"

namespace kestrel::testing {
namespace {

OpCase shape_case(const char* name, const char* cls, Shape in_shape, OpFn op, OpFn ref, bool grad = true) {
  OpCase c;
  c.name = name;
  c.shape_class = cls;
  c.make_inputs = [in_shape](DType dt, Device dev) -> OpInputs { return {randn(in_shape, dt, dev)}; };
  c.op = std::move(op);
  c.reference = std::move(ref);
  c.tol.bf16 = 0;  // pure data movement: exact
  c.tol.f32 = 0;
  c.tol.f64 = 0;
  c.gradcheck = grad;
  return c;
}

}  // namespace

void add_shape_cases(std::vector<OpCase>& cases) {
  for (auto [cls, in, out] : std::vector<std::tuple<const char*, Shape, Shape>>{
           {"7x13_to_13x7", {7, 13}, {13, 7}}, {"2x3x5_to_flat", {2, 3, 5}, {-1}}, {"127x8_to_4x2x127", {127, 8}, {4, 2, 127}}}) {
    Shape target = out;
    cases.push_back(shape_case(
        "reshape", cls, in, [target](const OpInputs& x) -> std::vector<Tensor> { return {reshape(x[0], target)}; },
        [target](const OpInputs& x) -> std::vector<Tensor> {
          Shape s = target;
          for (int64_t& d : s)
            if (d == -1) d = x[0].numel();
          return {f64_tensor(host_values(x[0]), s)};
        }));
  }
  // permute / transpose: out[i] = x[inverse-permuted index].
  for (auto [cls, in, dims] : std::vector<std::tuple<const char*, Shape, std::vector<int64_t>>>{
           {"2x3x5_p201", {2, 3, 5}, {2, 0, 1}}, {"7x1x13_p102", {7, 1, 13}, {1, 0, 2}}, {"127x33_p10", {127, 33}, {1, 0}}}) {
    std::vector<int64_t> perm = dims;
    cases.push_back(shape_case(
        "permute", cls, in,
        [perm](const OpInputs& x) -> std::vector<Tensor> { return {scale(permute(x[0], perm), 1.0)}; },
        [perm](const OpInputs& x) -> std::vector<Tensor> {
          Shape s, xs = x[0].shape();
          for (int64_t d : perm) s.push_back(xs[d]);
          return {gather_reference(x[0], s, [&](const std::vector<int64_t>& oi) {
            std::vector<int64_t> ii(oi.size());
            for (size_t d = 0; d < perm.size(); ++d) ii[perm[d]] = oi[d];
            return ravel(ii, xs);
          })};
        }));
  }
  cases.push_back(shape_case(
      "transpose", "3x4x5_t02", {3, 4, 5},
      [](const OpInputs& x) -> std::vector<Tensor> { return {contiguous(transpose(x[0], 0, 2))}; },
      [](const OpInputs& x) -> std::vector<Tensor> {
        Shape xs = x[0].shape();
        return {gather_reference(x[0], {5, 4, 3}, [&](const std::vector<int64_t>& oi) {
          return ravel({oi[2], oi[1], oi[0]}, xs);
        })};
      }));
  for (auto [cls, in, dim, start, len] : std::vector<std::tuple<const char*, Shape, int64_t, int64_t, int64_t>>{
           {"7x13_d1_s3_l5", {7, 13}, 1, 3, 5}, {"7x13_d0_s6_l1", {7, 13}, 0, 6, 1}, {"1000_s1_l998", {1000}, 0, 1, 998}}) {
    bool grad = in.size() > 1;
    cases.push_back(shape_case(
        "narrow", cls, in,
        [dim = dim, start = start, len = len](const OpInputs& x) -> std::vector<Tensor> {
          return {contiguous(narrow(x[0], dim, start, len))};
        },
        [dim = dim, start = start, len = len](const OpInputs& x) -> std::vector<Tensor> {
          Shape s = x[0].shape(), xs = x[0].shape();
          s[dim] = len;
          return {gather_reference(x[0], s, [&](const std::vector<int64_t>& oi) {
            auto ii = oi;
            ii[dim] += start;
            return ravel(ii, xs);
          })};
        },
        grad));
  }
  cases.push_back(shape_case(
      "unsqueeze", "7x13_d1", {7, 13}, [](const OpInputs& x) -> std::vector<Tensor> { return {unsqueeze(x[0], 1)}; },
      [](const OpInputs& x) -> std::vector<Tensor> { return {f64_tensor(host_values(x[0]), {7, 1, 13})}; }));
  cases.push_back(shape_case(
      "squeeze", "7x1x13_d1", {7, 1, 13}, [](const OpInputs& x) -> std::vector<Tensor> { return {squeeze(x[0], 1)}; },
      [](const OpInputs& x) -> std::vector<Tensor> { return {f64_tensor(host_values(x[0]), {7, 13})}; }));
  for (auto [cls, in, out] : std::vector<std::tuple<const char*, Shape, Shape>>{
           {"1x5_to_7x5", {1, 5}, {7, 5}}, {"3x1_to_2x3x4", {3, 1}, {2, 3, 4}}, {"1_to_127x9", {1}, {127, 9}}}) {
    Shape target = out;
    cases.push_back(shape_case(
        "expand", cls, in,
        [target](const OpInputs& x) -> std::vector<Tensor> { return {contiguous(expand(x[0], target))}; },
        [target](const OpInputs& x) -> std::vector<Tensor> {
          Shape xs = x[0].shape();
          return {gather_reference(x[0], target, [&](const std::vector<int64_t>& oi) {
            std::vector<int64_t> ii(xs.size());
            size_t lead = target.size() - xs.size();
            for (size_t d = 0; d < xs.size(); ++d) ii[d] = xs[d] == 1 ? 0 : oi[d + lead];
            return ravel(ii, xs);
          })};
        },
        numel(target) < 200));
  }
  // cast to f32 and back: exact for f32/bf16 inputs (f64 -> f32 rounds, hence the f64 tolerance).
  OpCase c = shape_case(
      "cast", "7x13_f32_roundtrip", {7, 13},
      [](const OpInputs& x) -> std::vector<Tensor> { return {cast(cast(x[0], DType::F32), x[0].dtype())}; },
      [](const OpInputs& x) -> std::vector<Tensor> { return {f64_tensor(host_values(x[0]), x[0].shape())}; }, false);
  c.tol.f64 = 1e-7;
  cases.push_back(c);
}

}  // namespace kestrel::testing
