// rope: validation and tape recording. The rotation is orthogonal, so backward is the same kernel
// rotating by the negated angle; only the positions are saved.
#include "kestrel/ops/rope.h"

#include "kernels/rope.h"
#include "kestrel/autograd/tape.h"

namespace kestrel {
namespace ag = autograd;

Tensor rope(const Tensor& x, const Tensor& positions, double theta, int64_t rotary_dim) {
  KESTREL_CHECK(x.defined() && positions.defined(), "rope", "undefined input");
  KESTREL_CHECK(is_floating(x.dtype()), "rope", "expected a floating tensor, got ", x.str());
  KESTREL_CHECK(x.dim() == 3, "rope", "x must be [tokens, heads, D], got ", x.str());
  KESTREL_CHECK(positions.dim() == 1 && positions.shape()[0] == x.shape()[0], "rope", "positions must be [",
                x.shape()[0], "], got ", positions.str());
  KESTREL_CHECK(positions.dtype() == DType::I32 || positions.dtype() == DType::I64, "rope",
                "positions must be i32 or i64, got ", positions.str());
  KESTREL_CHECK(positions.device() == x.device(), "rope", "positions ", positions.str(), " and x ", x.str(),
                " are on different devices");
  int64_t D = x.shape()[2];
  int64_t rd = rotary_dim < 0 ? D : rotary_dim;
  KESTREL_CHECK(rd % 2 == 0 && rd <= D && rd > 0, "rope", "rotary_dim must be even, positive and <= D=", D, ", got ",
                rotary_dim);
  KESTREL_CHECK(theta > 0, "rope", "theta must be positive, got ", theta);
  Tensor pos = positions.contiguous();
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (out.numel() > 0) kernels::dispatch(kernels::rope, "rope", x.device(), out, x.contiguous(), pos, theta, rd, false);
  if (!ag::should_record({x})) return out;
  ag::record("rope", {x}, out, [pos, theta, rd](const std::vector<Tensor>& g) -> std::vector<Tensor> {
    Tensor dx = Tensor::empty(g[0].shape(), g[0].dtype(), g[0].device());
    if (dx.numel() > 0) kernels::dispatch(kernels::rope, "rope", dx.device(), dx, g[0].contiguous(), pos, theta, rd, true);
    return {dx};
  });
  return out;
}

}  // namespace kestrel
