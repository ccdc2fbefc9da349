// Optimizer kernels: AdamW and global-norm gradient clipping. In-place, not recorded on the tape.
#pragma once

#include <vector>

#include "kestrel/runtime/tensor.h"

namespace kestrel {

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;  // decoupled: param -= lr * wd * param
};

// One AdamW step (torch.optim.AdamW semantics, bias-corrected, `step` counted from 1) on a master
// parameter (f32), its gradient (any floating dtype) and f32 moments m, v. When `param_copy` is
// defined (e.g. the bf16 weights the model computes with) it receives the updated values, rounded
// to nearest (or stochastically when `stochastic_rounding_seed` != 0).
void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, int64_t step,
                const AdamWOptions& options, const Tensor& param_copy = Tensor(),
                uint64_t stochastic_rounding_seed = 0);

// Global L2 norm over all gradients (f64 accumulation on the CPU), then scales them in place by
// min(1, max_norm / (norm + 1e-6)) when max_norm > 0. Returns the norm before clipping.
double clip_grad_norm(const std::vector<Tensor>& grads, double max_norm);
double global_grad_norm(const std::vector<Tensor>& grads);

// The same without a host synchronisation: the norm comes back as a [] f32 tensor on the gradients'
// device (the clip factor is computed and applied on the device), so a training step can read it
// only when it logs. Scaling is bitwise identical to clip_grad_norm. Every gradient must be on one
// device; an empty list gives a CPU zero.
Tensor clip_grad_norm_device(const std::vector<Tensor>& grads, double max_norm);
Tensor global_grad_norm_device(const std::vector<Tensor>& grads);

}  // namespace kestrel
