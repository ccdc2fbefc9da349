// Reductions: validation, keepdim bookkeeping and tape recording.
#include "kestrel/ops/reduce.h"

#include <algorithm>

#include "kernels/reduce.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/shape.h"

namespace kestrel {
namespace ag = autograd;
namespace {

Shape keep_shape(const Tensor& x, const std::vector<int64_t>& dims) {
  Shape s = x.shape();
  if (dims.empty()) {
    std::fill(s.begin(), s.end(), 1);
    return s;
  }
  for (int64_t d : dims) s[normalize_dim(d, x.dim(), "sum")] = 1;
  return s;
}

Shape drop_shape(const Tensor& x, const std::vector<int64_t>& dims) {
  if (dims.empty()) return {};
  std::vector<bool> drop(x.dim(), false);
  for (int64_t d : dims) drop[normalize_dim(d, x.dim(), "sum")] = true;
  Shape s;
  for (int64_t i = 0; i < x.dim(); ++i)
    if (!drop[i]) s.push_back(x.shape()[i]);
  return s;
}

Tensor sum_keep_raw(const Tensor& x, const Shape& kshape) {
  Tensor out = Tensor::empty(kshape, x.dtype(), x.device());
  if (x.numel() == 0) {
    out.zero_();
    return out;
  }
  kernels::dispatch(kernels::sum, "sum", x.device(), out, x);
  return out;
}

}  // namespace

Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  KESTREL_CHECK(is_floating(x.dtype()), "sum", "expected a floating tensor, got ", x.str());
  Shape kshape = keep_shape(x, dims);
  Tensor out = sum_keep_raw(x, kshape);
  if (!keepdim) out = out.view(drop_shape(x, dims));
  if (!ag::should_record({x})) return out;
  ag::record("sum", {x}, out, [kshape, xshape = x.shape()](const std::vector<Tensor>& g) -> std::vector<Tensor> {
    return {g[0].contiguous().view(kshape).expand_view(xshape).contiguous()};
  });
  return out;
}

Tensor mean(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  int64_t count = 1;
  Shape k = keep_shape(x, dims);
  for (size_t i = 0; i < k.size(); ++i)
    if (k[i] == 1) count *= x.shape()[i];
  return scale(sum(x, dims, keepdim), count > 0 ? 1.0 / static_cast<double>(count) : 0.0);
}

Tensor sum_to(const Tensor& x, const Shape& shape) {
  if (x.shape() == shape) return x;
  KESTREL_CHECK(x.dim() >= static_cast<int64_t>(shape.size()), "sum_to", "cannot reduce ", x.str(), " to ",
                shape_str(shape));
  size_t lead = x.shape().size() - shape.size();
  std::vector<int64_t> dims;
  for (size_t i = 0; i < x.shape().size(); ++i) {
    if (i < lead) {
      dims.push_back(static_cast<int64_t>(i));
    } else if (shape[i - lead] == 1 && x.shape()[i] != 1) {
      dims.push_back(static_cast<int64_t>(i));
    } else {
      KESTREL_CHECK(shape[i - lead] == x.shape()[i], "sum_to", "cannot reduce ", x.str(), " to ", shape_str(shape));
    }
  }
  Tensor r = dims.empty() ? x : sum(x, dims, true);
  return reshape(r, shape);
}

}  // namespace kestrel
