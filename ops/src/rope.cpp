// rope: validation and tape recording. The rotation is orthogonal, so backward is the same kernel
// rotating by the negated angle (times the same scaling); only the positions and the table are saved.
#include "kestrel/ops/rope.h"

#include <cmath>
#include <memory>

#include "kernels/rope.h"
#include "kestrel/autograd/tape.h"

namespace kestrel {
namespace ag = autograd;

RopeFrequencies RopeFrequencies::standard(double theta, int64_t rotary_dim) {
  KESTREL_CHECK(theta > 0, "rope", "theta must be positive, got ", theta);
  KESTREL_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0, "rope", "rotary_dim must be even and positive, got ",
                rotary_dim);
  RopeFrequencies f;
  f.inv_freq.resize(static_cast<size_t>(rotary_dim / 2));
  for (int64_t i = 0; i < rotary_dim / 2; ++i)
    f.inv_freq[i] = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(rotary_dim));
  return f;
}

Tensor rope(const Tensor& x, const Tensor& positions, const RopeFrequencies& freqs) {
  KESTREL_CHECK(x.defined() && positions.defined(), "rope", "undefined input");
  KESTREL_CHECK(is_floating(x.dtype()), "rope", "expected a floating tensor, got ", x.str());
  KESTREL_CHECK(x.dim() == 3, "rope", "x must be [tokens, heads, D], got ", x.str());
  KESTREL_CHECK(positions.dim() == 1 && positions.shape()[0] == x.shape()[0], "rope", "positions must be [",
                x.shape()[0], "], got ", positions.str());
  KESTREL_CHECK(positions.dtype() == DType::I32 || positions.dtype() == DType::I64, "rope",
                "positions must be i32 or i64, got ", positions.str());
  KESTREL_CHECK(positions.device() == x.device(), "rope", "positions ", positions.str(), " and x ", x.str(),
                " are on different devices");
  const int64_t D = x.shape()[2], rd = freqs.rotary_dim();
  KESTREL_CHECK(rd > 0 && rd <= D, "rope", "the frequency table covers rotary_dim=", rd, ", must be positive and <= D=",
                D);
  for (double f : freqs.inv_freq)
    KESTREL_CHECK(std::isfinite(f) && f >= 0, "rope", "inverse frequencies must be finite and >= 0, got ", f);
  KESTREL_CHECK(std::isfinite(freqs.attention_scaling), "rope", "attention_scaling must be finite, got ",
                freqs.attention_scaling);
  auto table = std::make_shared<const RopeFrequencies>(freqs);
  Tensor pos = positions.contiguous();
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (out.numel() > 0) kernels::dispatch(kernels::rope, "rope", x.device(), out, x.contiguous(), pos, *table, false);
  if (!ag::should_record({x})) return out;
  ag::record("rope", {x}, out, [pos, table](const std::vector<Tensor>& g) -> std::vector<Tensor> {
    Tensor dx = Tensor::empty(g[0].shape(), g[0].dtype(), g[0].device());
    if (dx.numel() > 0) kernels::dispatch(kernels::rope, "rope", dx.device(), dx, g[0].contiguous(), pos, *table, true);
    return {dx};
  });
  return out;
}

Tensor rope(const Tensor& x, const Tensor& positions, double theta, int64_t rotary_dim) {
  KESTREL_CHECK(x.defined() && x.dim() == 3, "rope", "x must be [tokens, heads, D], got ",
                x.defined() ? x.str() : std::string("undefined"));
  const int64_t D = x.shape()[2];
  const int64_t rd = rotary_dim < 0 ? D : rotary_dim;
  KESTREL_CHECK(rd % 2 == 0 && rd <= D && rd > 0, "rope", "rotary_dim must be even, positive and <= D=", D, ", got ",
                rotary_dim);
  KESTREL_CHECK(theta > 0, "rope", "theta must be positive, got ", theta);
  return rope(x, positions, RopeFrequencies::standard(theta, rd));
}

}  // namespace kestrel
