// rms_norm / add_rms_norm / layer_norm: validation, statistics buffers, tape recording with fused
// backward kernels (the saved statistics avoid a second reduction pass in backward).
#include "kestrel/ops/norm.h"

#include "kernels/norm.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/runtime/accumulate.h"

namespace kestrel {
namespace ag = autograd;
namespace {

DType stats_dtype(DType x) { return x == DType::F64 ? DType::F64 : DType::F32; }

int64_t check_norm_input(const Tensor& x, const char* op) {
  KESTREL_CHECK(x.defined(), op, "undefined input");
  KESTREL_CHECK(is_floating(x.dtype()), op, "expected a floating tensor, got ", x.str());
  KESTREL_CHECK(x.dim() >= 1 && x.shape().back() > 0, op, "expected input [..., C] with C > 0, got ", x.str());
  return x.shape().back();
}

void check_param(const Tensor& p, const Tensor& x, int64_t C, const char* what, const char* op) {
  if (!p.defined()) return;
  KESTREL_CHECK(p.dim() == 1 && p.shape()[0] == C, op, what, " must be [", C, "], got ", p.str());
  KESTREL_CHECK(p.dtype() == x.dtype(), op, what, " dtype ", dtype_name(p.dtype()), " differs from input dtype ",
                dtype_name(x.dtype()));
  KESTREL_CHECK(p.device() == x.device(), op, what, " is on ", p.str(), " but input on ", x.str());
}

Tensor rows_view(const Tensor& t, int64_t C) { return t.contiguous().view({-1, C}); }

Tensor grad_in(const Tensor& g, DType dt, int64_t C) { return rows_view(g.dtype() == dt ? g : g.to(dt), C); }

// Runs the rms_norm backward kernel; returns {dx [rows, C], dw [C] or undefined}.
std::pair<Tensor, Tensor> rms_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                                       bool need_w) {
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), x.device());
  Tensor dw = need_w ? Tensor::empty(w.shape(), w.dtype(), w.device()) : Tensor();
  kernels::dispatch(kernels::rms_norm_backward, "rms_norm", x.device(), dx, dw, dy, x, w, rstd);
  return {dx, dw};
}

}  // namespace

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  int64_t C = check_norm_input(x, "rms_norm");
  KESTREL_CHECK(weight.defined(), "rms_norm", "weight is required");
  check_param(weight, x, C, "weight", "rms_norm");
  Tensor x2 = rows_view(x, C);  // [rows, C]
  Tensor w = weight.contiguous();
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  Tensor rstd = Tensor::empty({x2.shape()[0]}, stats_dtype(x.dtype()), x.device());  // [rows]
  if (y.numel() > 0) kernels::dispatch(kernels::rms_norm_forward, "rms_norm", x.device(), y.view({-1, C}), rstd, x2, w, eps);
  if (!ag::should_record({x, weight})) return y;
  ag::record("rms_norm", {x, weight}, y,
             [xd = x2.detach(), wd = w.detach(), rstd, C, xs = x.shape(), gw = weight.requires_grad()](
                 const std::vector<Tensor>& g) -> std::vector<Tensor> {
               auto [dx, dw] = rms_backward(grad_in(g[0], xd.dtype(), C), xd, wd, rstd, gw);
               return {dx.view(xs), dw};
             });
  return y;
}

std::pair<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, double eps) {
  int64_t C = check_norm_input(x, "add_rms_norm");
  KESTREL_CHECK(residual.defined() && residual.shape() == x.shape(), "add_rms_norm", "residual must match x ",
                x.str(), ", got ", residual.defined() ? residual.str() : std::string("undefined"));
  KESTREL_CHECK(residual.dtype() == x.dtype() && residual.device() == x.device(), "add_rms_norm",
                "residual ", residual.str(), " differs in dtype or device from x ", x.str());
  KESTREL_CHECK(weight.defined(), "add_rms_norm", "weight is required");
  check_param(weight, x, C, "weight", "add_rms_norm");
  Tensor x2 = rows_view(x, C), r2 = rows_view(residual, C), w = weight.contiguous();
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  Tensor h = Tensor::empty(x.shape(), x.dtype(), x.device());
  Tensor rstd = Tensor::empty({x2.shape()[0]}, stats_dtype(x.dtype()), x.device());  // [rows]
  if (y.numel() > 0)
    kernels::dispatch(kernels::add_rms_norm_forward, "add_rms_norm", x.device(), y.view({-1, C}), h.view({-1, C}),
                      rstd, x2, r2, w, eps);
  if (!ag::should_record({x, residual, weight})) return {y, h};
  std::vector<Tensor> outs{y, h};
  ag::record("add_rms_norm", {x, residual, weight}, outs,
             [hd = h.view({-1, C}).detach(), wd = w.detach(), rstd, C, xs = x.shape(), gw = weight.requires_grad()](
                 const std::vector<Tensor>& g) -> std::vector<Tensor> {
               auto [dh, dw] = rms_backward(grad_in(g[0], hd.dtype(), C), hd, wd, rstd, gw);
               // h is also an output: its own gradient adds to the one through the norm.
               Tensor gh = grad_in(g[1], hd.dtype(), C);
               add_into(dh, gh);
               Tensor d = dh.view(xs);
               return {d, d, dw};
             });
  return {outs[0], outs[1]};
}

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  int64_t C = check_norm_input(x, "layer_norm");
  check_param(weight, x, C, "weight", "layer_norm");
  check_param(bias, x, C, "bias", "layer_norm");
  Tensor x2 = rows_view(x, C);
  Tensor w = weight.defined() ? weight.contiguous() : Tensor(), b = bias.defined() ? bias.contiguous() : Tensor();
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  Tensor mean = Tensor::empty({x2.shape()[0]}, stats_dtype(x.dtype()), x.device());  // [rows]
  Tensor rstd = Tensor::empty({x2.shape()[0]}, stats_dtype(x.dtype()), x.device());  // [rows]
  if (y.numel() > 0)
    kernels::dispatch(kernels::layer_norm_forward, "layer_norm", x.device(), y.view({-1, C}), mean, rstd, x2, w, b, eps);
  if (!ag::should_record({x, weight, bias})) return y;
  bool gw = weight.defined() && weight.requires_grad(), gb = bias.defined() && bias.requires_grad();
  ag::record("layer_norm", {x, weight, bias}, y,
             [xd = x2.detach(), wd = w.defined() ? w.detach() : Tensor(), mean, rstd, C, xs = x.shape(), gw, gb](
                 const std::vector<Tensor>& g) -> std::vector<Tensor> {
               Tensor dx = Tensor::empty(xd.shape(), xd.dtype(), xd.device());
               Tensor dw = gw ? Tensor::empty({C}, xd.dtype(), xd.device()) : Tensor();
               Tensor db = gb ? Tensor::empty({C}, xd.dtype(), xd.device()) : Tensor();
               kernels::dispatch(kernels::layer_norm_backward, "layer_norm", xd.device(), dx, dw, db,
                                 grad_in(g[0], xd.dtype(), C), xd, wd, mean, rstd);
               return {dx.view(xs), dw, db};
             });
  return y;
}

}  // namespace kestrel
