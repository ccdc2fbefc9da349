// Op-table cases for sum and mean over dims (keepdim or not), including full reductions.
#include <algorithm>

#include "kestrel/ops/reduce.h"
#include "support/op_table.h"

namespace kestrel::testing {
namespace {

// Sum (or mean) of x over dims, keepdim form first, then squeezed when !keepdim.
Tensor reduce_reference(const Tensor& x, std::vector<int64_t> dims, bool keepdim, bool mean) {
  const Shape& s = x.shape();
  if (dims.empty())
    for (size_t d = 0; d < s.size(); ++d) dims.push_back(static_cast<int64_t>(d));
  for (int64_t& d : dims) d = normalize_dim(d, x.dim(), "ref");
  Shape keep = s;
  for (int64_t d : dims) keep[d] = 1;
  std::vector<double> xv = host_values(x), o(static_cast<size_t>(numel(keep)), 0.0);
  for (int64_t i = 0; i < x.numel(); ++i) {
    auto idx = unravel(i, s);
    for (int64_t d : dims) idx[d] = 0;
    o[ravel(idx, keep)] += xv[i];
  }
  if (mean) {
    double count = static_cast<double>(x.numel()) / static_cast<double>(std::max<int64_t>(numel(keep), 1));
    for (double& v : o) v /= count;
  }
  Shape out;
  for (size_t d = 0; d < s.size(); ++d)
    if (keepdim || std::find(dims.begin(), dims.end(), static_cast<int64_t>(d)) == dims.end()) out.push_back(keep[d]);
  return f64_tensor(o, out);
}

}  // namespace

void add_reduce_cases(std::vector<OpCase>& cases) {
  struct Spec {
    const char* cls;
    Shape shape;
    std::vector<int64_t> dims;
    bool keepdim, grad;
  };
  const Spec specs[] = {
      {"n1_all", {1}, {}, false, true},
      {"n7_all", {7}, {}, false, true},
      {"7x13_dim0", {7, 13}, {0}, false, true},
      {"7x13_dim1_keep", {7, 13}, {-1}, true, true},
      {"3x5x7_dims02", {3, 5, 7}, {0, 2}, false, true},
      {"3x5x7_dim1_keep", {3, 5, 7}, {1}, true, true},
      {"127x1000_dim1", {127, 1000}, {1}, false, false},
      {"127x1000_dim0", {127, 1000}, {0}, false, false},
      {"n1000_all", {1000}, {}, false, false},
  };
  for (bool is_mean : {false, true}) {
    for (const Spec& sp : specs) {
      OpCase c;
      c.name = is_mean ? "mean" : "sum";
      c.shape_class = sp.cls;
      c.make_inputs = [s = sp.shape](DType dt, Device dev) -> OpInputs { return {randn(s, dt, dev)}; };
      c.op = [dims = sp.dims, k = sp.keepdim, is_mean](const OpInputs& in) -> std::vector<Tensor> {
        return {is_mean ? mean(in[0], dims, k) : sum(in[0], dims, k)};
      };
      c.reference = [dims = sp.dims, k = sp.keepdim, is_mean](const OpInputs& in) -> std::vector<Tensor> {
        return {reduce_reference(in[0], dims, k, is_mean)};
      };
      c.gradcheck = sp.grad;
      cases.push_back(c);
    }
  }
}

}  // namespace kestrel::testing
