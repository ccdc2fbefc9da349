// softmax / log_softmax / logsumexp / amax along one dim: validation, [outer, n, inner] addressing,
// tape recording. softmax and log_softmax have fused backward kernels; logsumexp's backward is
// softmax(x) * g, amax's a scatter to the first maximal element.
#include "kestrel/ops/softmax.h"

#include "kernels/softmax.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/ops/elementwise.h"

namespace kestrel {
namespace ag = autograd;
using kernels::ReduceDim;
namespace {

ReduceDim reduce_dim(const Tensor& x, int d) {
  ReduceDim r{1, x.shape()[d], 1};
  for (int i = 0; i < d; ++i) r.outer *= x.shape()[i];
  for (int64_t i = d + 1; i < x.dim(); ++i) r.inner *= x.shape()[i];
  return r;
}

int check_input(const Tensor& x, int64_t dim, const char* op) {
  KESTREL_CHECK(x.defined(), op, "undefined input");
  KESTREL_CHECK(is_floating(x.dtype()), op, "expected a floating tensor, got ", x.str());
  KESTREL_CHECK(x.dim() >= 1, op, "expected at least 1-D input, got ", x.str());
  return normalize_dim(dim, x.dim(), op);
}

Shape reduced_shape(const Tensor& x, int d, bool keepdim) {
  Shape s = x.shape();
  if (keepdim) s[d] = 1;
  else s.erase(s.begin() + d);
  return s;
}

Tensor softmax_raw(const Tensor& x, int d, bool log, const char* op) {
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (out.numel() > 0)
    kernels::dispatch(kernels::softmax_forward, op, x.device(), out, x.contiguous(), reduce_dim(x, d), log);
  return out;
}

Tensor softmax_impl(const Tensor& x, int64_t dim, bool log, const char* op) {
  int d = check_input(x, dim, op);
  Tensor out = softmax_raw(x, d, log, op);
  if (!ag::should_record({x})) return out;
  ReduceDim r = reduce_dim(x, d);
  ag::record(op, {x}, out, [y = out.detach(), r, log, op](const std::vector<Tensor>& g) -> std::vector<Tensor> {
    Tensor dx = Tensor::empty(y.shape(), y.dtype(), y.device());
    Tensor dy = g[0].dtype() == y.dtype() ? g[0].contiguous() : g[0].to(y.dtype());
    if (dx.numel() > 0) kernels::dispatch(kernels::softmax_backward, op, y.device(), dx, y, dy, r, log);
    return {dx};
  });
  return out;
}

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) { return softmax_impl(x, dim, false, "softmax"); }
Tensor log_softmax(const Tensor& x, int64_t dim) { return softmax_impl(x, dim, true, "log_softmax"); }

Tensor logsumexp(const Tensor& x, int64_t dim, bool keepdim) {
  int d = check_input(x, dim, "logsumexp");
  KESTREL_CHECK(x.shape()[d] > 0, "logsumexp", "cannot reduce an empty dim ", d, " of ", x.str());
  ReduceDim r = reduce_dim(x, d);
  Tensor out = Tensor::empty(reduced_shape(x, d, keepdim), x.dtype(), x.device());
  if (out.numel() > 0) kernels::dispatch(kernels::logsumexp_forward, "logsumexp", x.device(), out, x.contiguous(), r);
  if (!ag::should_record({x})) return out;
  ag::record("logsumexp", {x}, out,
             [xd = x.detach(), d, keep = reduced_shape(x, d, true)](const std::vector<Tensor>& g) -> std::vector<Tensor> {
               // d lse / dx = softmax(x).
               Tensor p = softmax_raw(xd, d, false, "logsumexp");
               return {mul(p, g[0].contiguous().view(keep))};
             });
  return out;
}

Tensor amax(const Tensor& x, int64_t dim, bool keepdim) {
  int d = check_input(x, dim, "amax");
  KESTREL_CHECK(x.shape()[d] > 0, "amax", "cannot reduce an empty dim ", d, " of ", x.str());
  ReduceDim r = reduce_dim(x, d);
  Shape s = reduced_shape(x, d, keepdim);
  Tensor out = Tensor::empty(s, x.dtype(), x.device());
  Tensor idx = Tensor::empty(s, DType::I64, x.device());
  if (out.numel() > 0) kernels::dispatch(kernels::amax_forward, "amax", x.device(), out, idx, x.contiguous(), r);
  if (!ag::should_record({x})) return out;
  ag::record("amax", {x}, out, [idx, r, xs = x.shape(), dt = x.dtype()](const std::vector<Tensor>& g) -> std::vector<Tensor> {
    Tensor dx = Tensor::zeros(xs, dt, idx.device());
    Tensor dy = g[0].dtype() == dt ? g[0].contiguous() : g[0].to(dt);
    if (idx.numel() > 0) kernels::dispatch(kernels::amax_backward, "amax", idx.device(), dx, dy, idx, r);
    return {dx};
  });
  return out;
}

}  // namespace kestrel
