// Differentiable views and layout ops.
#include "kestrel/ops/shape.h"

#include <numeric>

#include "kestrel/autograd/tape.h"
#include "kestrel/ops/reduce.h"

namespace kestrel {
namespace ag = autograd;

Tensor reshape(const Tensor& x, const Shape& shape) {
  Tensor out = x.is_contiguous() ? x.view(shape) : x.contiguous().view(shape);
  if (!ag::should_record({x})) return out;
  out = out.detach();
  ag::record("reshape", {x}, out, [in_shape = x.shape()](const std::vector<Tensor>& g) -> std::vector<Tensor> {
    return {reshape(g[0], in_shape)};
  });
  return out;
}

Tensor permute(const Tensor& x, const std::vector<int64_t>& dims) {
  Tensor out = x.permute_view(dims).detach();
  if (!ag::should_record({x})) return out;
  std::vector<int64_t> inv(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) inv[normalize_dim(dims[i], x.dim(), "permute")] = static_cast<int64_t>(i);
  ag::record("permute", {x}, out, [inv](const std::vector<Tensor>& g) -> std::vector<Tensor> {
    return {permute(g[0], inv)};
  });
  return out;
}

Tensor transpose(const Tensor& x, int64_t d0, int64_t d1) {
  std::vector<int64_t> dims(x.dim());
  std::iota(dims.begin(), dims.end(), 0);
  std::swap(dims[normalize_dim(d0, x.dim(), "transpose")], dims[normalize_dim(d1, x.dim(), "transpose")]);
  return permute(x, dims);
}

Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length) {
  Tensor out = x.narrow_view(dim, start, length).detach();
  if (!ag::should_record({x})) return out;
  int d = normalize_dim(dim, x.dim(), "narrow");
  ag::record("narrow", {x}, out, [shape = x.shape(), d, start, length](const std::vector<Tensor>& g) -> std::vector<Tensor> {
    Tensor gx = Tensor::zeros(shape, g[0].dtype(), g[0].device());
    gx.narrow_view(d, start, length).copy_(g[0]);
    return {gx};
  });
  return out;
}

Tensor unsqueeze(const Tensor& x, int64_t dim) {
  int d = normalize_dim(dim, x.dim() + 1, "unsqueeze");
  Shape s = x.shape();
  s.insert(s.begin() + d, 1);
  return reshape(x, s);
}

Tensor squeeze(const Tensor& x, int64_t dim) {
  int d = normalize_dim(dim, x.dim(), "squeeze");
  KESTREL_CHECK(x.shape()[d] == 1, "squeeze", "dim ", d, " of ", x.str(), " has size ", x.shape()[d], ", not 1");
  Shape s = x.shape();
  s.erase(s.begin() + d);
  return reshape(x, s);
}

Tensor expand(const Tensor& x, const Shape& shape) {
  Tensor out = x.expand_view(shape).detach();
  if (!ag::should_record({x})) return out;
  ag::record("expand", {x}, out, [in_shape = x.shape()](const std::vector<Tensor>& g) -> std::vector<Tensor> {
    return {sum_to(g[0], in_shape)};
  });
  return out;
}

Tensor contiguous(const Tensor& x) {
  if (x.is_contiguous()) return x;
  Tensor out = x.clone();
  if (!ag::should_record({x})) return out;
  ag::record("contiguous", {x}, out, [](const std::vector<Tensor>& g) -> std::vector<Tensor> { return {g[0]}; });
  return out;
}

Tensor cast(const Tensor& x, DType dtype) {
  if (x.dtype() == dtype) return x;
  Tensor out = x.to(dtype);
  if (!ag::should_record({x})) return out;
  KESTREL_CHECK(is_floating(dtype), "cast", "cannot differentiate a cast of ", x.str(), " to ", dtype_name(dtype));
  ag::record("cast", {x}, out, [src = x.dtype()](const std::vector<Tensor>& g) -> std::vector<Tensor> {
    return {g[0].to(src)};
  });
  return out;
}

Tensor to_device(const Tensor& x, Device device) {
  if (x.device() == device) return x;
  Tensor out = x.to(device);
  if (!ag::should_record({x})) return out;
  ag::record("to_device", {x}, out, [src = x.device()](const std::vector<Tensor>& g) -> std::vector<Tensor> {
    return {g[0].to(src)};
  });
  return out;
}

}  // namespace kestrel
