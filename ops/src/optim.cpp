// Optimizer ops: argument checks and dispatch for AdamW and global-norm gradient clipping. These
// update tensors in place and are never recorded on the tape.
#include "kestrel/ops/optim.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/optim.h"
#include "kestrel/ops/adamw_q8.h"

namespace kestrel {
namespace {

// Contiguous tensors grouped by device, undefined ones dropped.
std::vector<std::pair<Device, std::vector<Tensor>>> by_device(const std::vector<Tensor>& grads, const char* op) {
  std::vector<std::pair<Device, std::vector<Tensor>>> groups;
  for (size_t i = 0; i < grads.size(); ++i) {
    const Tensor& g = grads[i];
    if (!g.defined()) continue;
    KESTREL_CHECK(is_floating(g.dtype()), op, "gradient ", i, " is not floating: ", g.str());
    KESTREL_CHECK(g.is_contiguous(), op, "gradient ", i, " must be contiguous, got ", g.str());
    if (g.numel() == 0) continue;
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& p) { return p.first == g.device(); });
    if (it == groups.end()) {
      groups.push_back({g.device(), {}});
      it = groups.end() - 1;
    }
    it->second.push_back(g.detach());
  }
  return groups;
}

double norm_of(const std::vector<std::pair<Device, std::vector<Tensor>>>& groups) {
  double ss = 0;
  for (const auto& [device, ts] : groups) ss += kernels::dispatch(kernels::sum_squares, "global_grad_norm", device, ts);
  return std::sqrt(ss);
}

}  // namespace

namespace {

void check_hyper(const AdamWOptions& options, int64_t step, const char* op) {
  KESTREL_CHECK(step >= 1, op, "step counts from 1, got ", step);
  KESTREL_CHECK(options.lr >= 0 && options.eps > 0 && options.beta1 >= 0 && options.beta1 < 1 &&
                    options.beta2 >= 0 && options.beta2 < 1 && options.weight_decay >= 0,
                op, "invalid hyperparameters: lr ", options.lr, ", betas (", options.beta1, ", ", options.beta2,
                "), eps ", options.eps, ", weight_decay ", options.weight_decay);
}

// param: an f32 master (f64 too on the CPU when f64_ok), or a bf16/f16 parameter updated in place
// (then no param_copy).
void check_param(const Tensor& param, const Tensor& grad, const Tensor& param_copy, bool f64_ok, const char* op) {
  const bool sixteen = param.dtype() == DType::BF16 || param.dtype() == DType::F16;
  KESTREL_CHECK(param.dtype() == DType::F32 || sixteen || (f64_ok && param.dtype() == DType::F64 && param.device().is_cpu()),
                op, "the master parameter must be f32 (or, without a master, bf16/f16), got ", param.str());
  KESTREL_CHECK(!(sixteen && param_copy.defined()), op, "a ", dtype_name(param.dtype()),
                " parameter is updated in place (no master): param_copy must be undefined, got ", param_copy.str());
  KESTREL_CHECK(is_floating(grad.dtype()), op, "grad must be floating, got ", grad.str());
  KESTREL_CHECK(grad.shape() == param.shape(), op, "shapes differ: param ", param.str(), ", grad ", grad.str());
  KESTREL_CHECK(grad.device() == param.device(), op, "devices differ: param ", param.str(), ", grad ", grad.str());
  KESTREL_CHECK(param.is_contiguous(), op, "param must be contiguous, got ", param.str());
  if (param_copy.defined()) {
    KESTREL_CHECK(param_copy.shape() == param.shape() && param_copy.device() == param.device(), op,
                  "param_copy ", param_copy.str(), " must match param ", param.str());
    KESTREL_CHECK(is_floating(param_copy.dtype()) && param_copy.is_contiguous(), op,
                  "param_copy must be a contiguous floating tensor, got ", param_copy.str());
  }
}

}  // namespace

void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, int64_t step,
                const AdamWOptions& options, const Tensor& param_copy, uint64_t stochastic_rounding_seed,
                const Tensor& grad_scale) {
  constexpr const char* kOp = "adamw_step";
  KESTREL_CHECK(param.defined() && grad.defined() && m.defined() && v.defined(), kOp,
                "param, grad, m and v must be defined");
  check_param(param, grad, param_copy, /*f64_ok=*/true, kOp);
  const DType md = param.dtype() == DType::F64 ? DType::F64 : DType::F32;
  KESTREL_CHECK(m.dtype() == md && v.dtype() == md, kOp, "moments must be ", dtype_name(md), " for a ",
                dtype_name(param.dtype()), " parameter, got m ", m.str(), " and v ", v.str());
  KESTREL_CHECK(m.shape() == param.shape() && v.shape() == param.shape(), kOp, "shapes differ: param ", param.str(),
                ", grad ", grad.str(), ", m ", m.str(), ", v ", v.str());
  KESTREL_CHECK(m.device() == param.device() && v.device() == param.device(), kOp, "devices differ: param ",
                param.str(), ", grad ", grad.str(), ", m ", m.str(), ", v ", v.str());
  KESTREL_CHECK(m.is_contiguous() && v.is_contiguous(), kOp, "param, m and v must be contiguous");
  check_hyper(options, step, kOp);
  if (param.numel() == 0) return;
  if (grad_scale.defined())
    KESTREL_CHECK(grad_scale.dtype() == DType::I64 && grad_scale.numel() == 1 && grad_scale.device() == param.device(),
                  kOp, "grad_scale must be grad_clip_factor_device's factor (an f64 in a [] i64 slot) on ",
                  param.device().str(), ", got ", grad_scale.str());
  kernels::AdamWTensors t{param.detach(), grad.detach().contiguous(), m.detach(), v.detach(),
                          param_copy.defined() ? param_copy.detach() : Tensor(), stochastic_rounding_seed,
                          grad_scale.defined() ? grad_scale.detach() : Tensor()};
  kernels::AdamWHyper h{options.lr, options.beta1, options.beta2, options.eps, options.weight_decay, step};
  kernels::dispatch(kernels::adamw, kOp, param.device(), std::vector<kernels::AdamWTensors>{t}, h);
}

Q8Moments Q8Moments::zeros(int64_t numel, Device device) {
  KESTREL_CHECK(numel >= 0, "adamw_step_q8", "numel must be >= 0, got ", numel);
  const int64_t nb = q8::num_blocks(numel);
  return Q8Moments{Tensor::zeros({numel}, DType::U8, device), Tensor::zeros({numel}, DType::U8, device),
                   Tensor::zeros({nb}, DType::F32, device), Tensor::zeros({nb}, DType::F32, device)};
}

int64_t Q8Moments::nbytes() const {
  if (!m_codes.defined()) return 0;
  return static_cast<int64_t>(m_codes.nbytes() + v_codes.nbytes() + m_scale.nbytes() + v_scale.nbytes());
}

namespace {
Tensor dequantize(const Tensor& codes, const Tensor& scale, bool is_m) {
  const Tensor c = codes.to(Device::cpu()), s = scale.to(Device::cpu());
  Tensor out = Tensor::empty({c.numel()}, DType::F32, Device::cpu());
  const uint8_t* pc = c.data<uint8_t>();
  const float* ps = s.data<float>();
  float* po = out.data<float>();
  for (int64_t i = 0; i < c.numel(); ++i)
    po[i] = (is_m ? q8::decode_m(pc[i]) : q8::decode_v(pc[i])) * ps[i / q8::kBlock];
  return out;
}
}  // namespace

Tensor Q8Moments::m() const { return dequantize(m_codes, m_scale, true); }
Tensor Q8Moments::v() const { return dequantize(v_codes, v_scale, false); }

void adamw_step_q8(const Tensor& param, const Tensor& grad, const Q8Moments& state, int64_t step,
                   const AdamWOptions& options, const Tensor& param_copy, uint64_t stochastic_rounding_seed,
                   uint64_t moment_seed) {
  constexpr const char* kOp = "adamw_step_q8";
  KESTREL_CHECK(param.defined() && grad.defined() && state.m_codes.defined() && state.v_codes.defined() &&
                    state.m_scale.defined() && state.v_scale.defined(),
                kOp, "param, grad and the four state tensors must be defined");
  check_param(param, grad, param_copy, /*f64_ok=*/false, kOp);
  const int64_t n = param.numel(), nb = q8::num_blocks(n);
  for (const Tensor* c : {&state.m_codes, &state.v_codes})
    KESTREL_CHECK(c->dtype() == DType::U8 && c->numel() == n && c->is_contiguous() && c->device() == param.device(),
                  kOp, "codes must be contiguous u8 with param's ", n, " elements on ", param.device().str(), ", got ",
                  c->str());
  for (const Tensor* sc : {&state.m_scale, &state.v_scale})
    KESTREL_CHECK(sc->dtype() == DType::F32 && sc->numel() == nb && sc->is_contiguous() && sc->device() == param.device(),
                  kOp, "scales must be contiguous f32 with ceil(", n, " / ", q8::kBlock, ") = ", nb, " elements on ",
                  param.device().str(), ", got ", sc->str());
  check_hyper(options, step, kOp);
  if (n == 0) return;
  kernels::AdamWQ8Tensors t{param.detach(), grad.detach().contiguous(), param_copy.defined() ? param_copy.detach() : Tensor(),
                            state.m_codes, state.v_codes, state.m_scale, state.v_scale, stochastic_rounding_seed,
                            moment_seed};
  kernels::AdamWHyper h{options.lr, options.beta1, options.beta2, options.eps, options.weight_decay, step};
  kernels::dispatch(kernels::adamw_q8, kOp, param.device(), std::vector<kernels::AdamWQ8Tensors>{t}, h);
}

double global_grad_norm(const std::vector<Tensor>& grads) { return norm_of(by_device(grads, "global_grad_norm")); }

double clip_grad_norm(const std::vector<Tensor>& grads, double max_norm) {
  auto groups = by_device(grads, "clip_grad_norm");
  double norm = norm_of(groups);
  // A non-finite norm leaves the gradients untouched (the caller decides whether to skip the step).
  if (max_norm > 0 && std::isfinite(norm)) {
    double coef = max_norm / (norm + 1e-6);
    if (coef < 1.0)
      for (const auto& [device, ts] : groups) kernels::dispatch(kernels::scale_in_place, "clip_grad_norm", device, ts, coef);
  }
  return norm;
}

Tensor clip_grad_norm_device(const std::vector<Tensor>& grads, double max_norm) {
  auto groups = by_device(grads, "clip_grad_norm_device");
  KESTREL_CHECK(groups.size() <= 1, "clip_grad_norm_device", "gradients on ", groups.size(),
                " devices; the device-side norm needs one (use clip_grad_norm)");
  if (groups.empty()) return Tensor::zeros({}, DType::F32, Device::cpu());
  const auto& [device, ts] = groups.front();
  if (device.is_cpu()) {  // no synchronisation to avoid: the host path, its norm as a tensor
    double norm = clip_grad_norm(ts, max_norm);
    return Tensor::full({}, norm, DType::F32, device);
  }
  Tensor norm = Tensor::empty({}, DType::F32, device);
  kernels::dispatch(kernels::clip_by_global_norm, "clip_grad_norm_device", device, ts, norm, max_norm, Tensor());
  return norm;
}

double GradClip::factor_value() const {
  Tensor h = factor.to(Device::cpu());
  double v = 0;
  std::memcpy(&v, h.data_ptr(), sizeof(double));
  return v;
}

GradClip grad_clip_factor_device(const std::vector<Tensor>& grads, double max_norm) {
  auto groups = by_device(grads, "grad_clip_factor_device");
  KESTREL_CHECK(groups.size() <= 1, "grad_clip_factor_device", "gradients on ", groups.size(),
                " devices; the device-side norm needs one");
  const Device device = groups.empty() ? Device::cpu() : groups.front().first;
  if (device.is_cpu()) {  // clip_grad_norm's norm and factor, computed as it computes them
    const double norm = groups.empty() ? 0.0 : norm_of(groups);
    double factor = 1.0;
    if (max_norm > 0 && std::isfinite(norm)) factor = std::min(1.0, max_norm / (norm + 1e-6));
    GradClip c{Tensor::full({}, norm, DType::F32, device), Tensor::empty({}, DType::I64, device)};
    std::memcpy(c.factor.data_ptr(), &factor, sizeof(double));
    return c;
  }
  GradClip c{Tensor::empty({}, DType::F32, device), Tensor::empty({}, DType::I64, device)};
  kernels::dispatch(kernels::clip_by_global_norm, "grad_clip_factor_device", device, groups.front().second, c.norm,
                    max_norm, c.factor);
  return c;
}

Tensor global_grad_norm_device(const std::vector<Tensor>& grads) { return clip_grad_norm_device(grads, 0.0); }

}  // namespace kestrel
