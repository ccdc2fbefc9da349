// silu / gelu / relu / swiglu: validation and tape recording with fused backward kernels. Each saves
// only its input(s); the derivative is recomputed in backward (cheaper than storing it).
#include "kestrel/ops/activation.h"

#include "kernels/activation.h"
#include "kestrel/autograd/tape.h"
#include "src/fp8_input.h"

namespace kestrel {
namespace ag = autograd;
using kernels::Activation;
namespace {

Tensor as_dtype(const Tensor& g, DType dt) { return g.dtype() == dt ? g.contiguous() : g.to(dt); }

Tensor activation(Activation kind, const Tensor& x, const char* op) {
  KESTREL_CHECK(x.defined(), op, "undefined input");
  KESTREL_CHECK(is_floating(x.dtype()), op, "expected a floating tensor, got ", x.str());
  Tensor xc = x.contiguous();
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (out.numel() > 0) kernels::dispatch(kernels::activation_forward, op, x.device(), kind, out, xc);
  if (!ag::should_record({x})) return out;
  ag::record(op, {x}, out, [kind, op, xd = xc.detach()](const std::vector<Tensor>& g) -> std::vector<Tensor> {
    Tensor dx = Tensor::empty(xd.shape(), xd.dtype(), xd.device());
    if (dx.numel() > 0)
      kernels::dispatch(kernels::activation_backward, op, xd.device(), kind, dx, xd, as_dtype(g[0], xd.dtype()));
    return {dx};
  });
  return out;
}

}  // namespace

Tensor silu(const Tensor& x) { return activation(Activation::Silu, x, "silu"); }
Tensor gelu(const Tensor& x, bool tanh_approx) {
  return activation(tanh_approx ? Activation::GeluTanh : Activation::GeluErf, x, "gelu");
}
Tensor relu(const Tensor& x) { return activation(Activation::Relu, x, "relu"); }

Tensor swiglu(const Tensor& gate, const Tensor& up) { return detail::swiglu(gate, up, nullptr); }

namespace detail {

Tensor swiglu(const Tensor& gate, const Tensor& up, const kernels::Fp8CastTarget* fp8) {
  KESTREL_CHECK(gate.defined() && up.defined(), "swiglu", "undefined input");
  KESTREL_CHECK(is_floating(gate.dtype()), "swiglu", "expected a floating tensor, got ", gate.str());
  KESTREL_CHECK(gate.shape() == up.shape() && gate.dtype() == up.dtype() && gate.device() == up.device(), "swiglu",
                "gate ", gate.str(), " and up ", up.str(), " must have one shape, dtype and device");
  Tensor gc = gate.contiguous(), uc = up.contiguous();
  Tensor out = Tensor::empty(gate.shape(), gate.dtype(), gate.device());
  const Device d = gate.device();
  // With `fp8` (fp8_input.h): the fused kernel where the device has one for the shape, else the plain
  // kernel and the cast of the stored output. The FP8 target is over [rows, C] (C the last dim).
  auto rows = [&](const Tensor& t) { return t.view({-1, gate.shape().back()}); };
  const auto& slot = kernels::swiglu_fp8_forward;  // CUDA only (a test may install a CPU one)
  const bool fused = fp8 && out.numel() > 0 && (d.is_cuda() ? slot.cuda : slot.cpu) &&
                     kernels::dispatch(slot, "swiglu", d, rows(out), rows(gc), rows(uc), *fp8);
  if (!fused) {
    if (out.numel() > 0) kernels::dispatch(kernels::swiglu_forward, "swiglu", d, out, gc, uc);
    if (fp8) kernels::dispatch(kernels::fp8_cast, "fp8_cast", d, rows(out), *fp8);
  }
  if (!ag::should_record({gate, up})) return out;
  ag::record("swiglu", {gate, up}, out, [gd = gc.detach(), ud = uc.detach()](const std::vector<Tensor>& g) -> std::vector<Tensor> {
    Tensor dg = Tensor::empty(gd.shape(), gd.dtype(), gd.device());
    Tensor du = Tensor::empty(gd.shape(), gd.dtype(), gd.device());
    if (dg.numel() > 0)
      kernels::dispatch(kernels::swiglu_backward, "swiglu", gd.device(), dg, du, gd, ud, as_dtype(g[0], gd.dtype()));
    return {dg, du};
  });
  return out;
}

}  // namespace detail
}  // namespace kestrel
