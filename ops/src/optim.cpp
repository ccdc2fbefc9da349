// Optimizer ops: argument checks and dispatch for AdamW and global-norm gradient clipping. These
// update tensors in place and are never recorded on the tape.
#include "kestrel/ops/optim.h"

#include <algorithm>
#include <cmath>

#include "kernels/optim.h"

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

void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, int64_t step,
                const AdamWOptions& options, const Tensor& param_copy, uint64_t stochastic_rounding_seed) {
  constexpr const char* kOp = "adamw_step";
  KESTREL_CHECK(param.defined() && grad.defined() && m.defined() && v.defined(), kOp,
                "param, grad, m and v must be defined");
  KESTREL_CHECK(param.dtype() == DType::F32 || (param.dtype() == DType::F64 && param.device().is_cpu()), kOp,
                "the master parameter must be f32, got ", param.str());
  KESTREL_CHECK(m.dtype() == param.dtype() && v.dtype() == param.dtype(), kOp, "moments must be ",
                dtype_name(param.dtype()), " like the parameter, got m ", m.str(), " and v ", v.str());
  KESTREL_CHECK(is_floating(grad.dtype()), kOp, "grad must be floating, got ", grad.str());
  KESTREL_CHECK(grad.shape() == param.shape() && m.shape() == param.shape() && v.shape() == param.shape(), kOp,
                "shapes differ: param ", param.str(), ", grad ", grad.str(), ", m ", m.str(), ", v ", v.str());
  KESTREL_CHECK(grad.device() == param.device() && m.device() == param.device() && v.device() == param.device(), kOp,
                "devices differ: param ", param.str(), ", grad ", grad.str(), ", m ", m.str(), ", v ", v.str());
  KESTREL_CHECK(param.is_contiguous() && m.is_contiguous() && v.is_contiguous(), kOp,
                "param, m and v must be contiguous");
  KESTREL_CHECK(step >= 1, kOp, "step counts from 1, got ", step);
  KESTREL_CHECK(options.lr >= 0 && options.eps > 0 && options.beta1 >= 0 && options.beta1 < 1 &&
                    options.beta2 >= 0 && options.beta2 < 1 && options.weight_decay >= 0,
                kOp, "invalid hyperparameters: lr ", options.lr, ", betas (", options.beta1, ", ", options.beta2,
                "), eps ", options.eps, ", weight_decay ", options.weight_decay);
  if (param_copy.defined()) {
    KESTREL_CHECK(param_copy.shape() == param.shape() && param_copy.device() == param.device(), kOp,
                  "param_copy ", param_copy.str(), " must match param ", param.str());
    KESTREL_CHECK(is_floating(param_copy.dtype()) && param_copy.is_contiguous(), kOp,
                  "param_copy must be a contiguous floating tensor, got ", param_copy.str());
  }
  if (param.numel() == 0) return;
  kernels::AdamWTensors t{param.detach(), grad.detach().contiguous(), m.detach(), v.detach(),
                          param_copy.defined() ? param_copy.detach() : Tensor(), stochastic_rounding_seed};
  kernels::AdamWHyper h{options.lr, options.beta1, options.beta2, options.eps, options.weight_decay, step};
  kernels::dispatch(kernels::adamw, kOp, param.device(), std::vector<kernels::AdamWTensors>{t}, h);
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
  kernels::dispatch(kernels::clip_by_global_norm, "clip_grad_norm_device", device, ts, norm, max_norm);
  return norm;
}

Tensor global_grad_norm_device(const std::vector<Tensor>& grads) { return clip_grad_norm_device(grads, 0.0); }

}  // namespace kestrel
