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
// Without a master (optimizer.master_weights "none"): `param` may itself be bf16/f16 (no
// param_copy); the update is the same f32 arithmetic on its widened value, stored back rounded
// stochastically with `stochastic_rounding_seed` (to nearest when 0), bit-identical on CPU and CUDA.
// `grad_scale`: undefined, or grad_clip_factor_device's factor on the parameter's device:
// the gradient is multiplied by it and rounded to its dtype before the update, as clip_grad_norm's
// in-place scaling rounds it, so the step equals clipping then stepping, bit for bit, while the
// gradient tensor itself is left unscaled (one pass over the gradients fewer).
void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, int64_t step,
                const AdamWOptions& options, const Tensor& param_copy = Tensor(),
                uint64_t stochastic_rounding_seed = 0, const Tensor& grad_scale = Tensor());

// AdamW's moments stored as 8-bit block-wise codes (adamw_q8.h: blocks of 2048 elements, one f32
// absmax per block, logarithmic codes, signed for m and unsigned for v): 2 bytes + 0.4% per
// parameter instead of 8.
struct Q8Moments {
  Tensor m_codes, v_codes;  // [numel] u8
  Tensor m_scale, v_scale;  // [ceil(numel / 2048)] f32, the blocks' absmax
  static Q8Moments zeros(int64_t numel, Device device);
  int64_t numel() const { return m_codes.defined() ? m_codes.numel() : 0; }
  int64_t nbytes() const;
  Tensor m() const;  // dequantised, [numel] f32 on the CPU (tests, inspection)
  Tensor v() const;
};

// One AdamW step with 8-bit moments: dequantise, update in f32 (adamw_step's arithmetic operation
// by operation), requantise with new block scales, all in one pass (one kernel on CUDA). `param` is
// an f32 master (with an optional param_copy, as adamw_step) or a bf16/f16 parameter updated in
// place (no master). `stochastic_rounding_seed` rounds the 16-bit parameter (or copy) as adamw_step
// does; `moment_seed` rounds the moments' codes stochastically (0: to nearest; see adamw_q8.h for
// why stochastic is the default of the trainer). CPU and CUDA give the same bits.
void adamw_step_q8(const Tensor& param, const Tensor& grad, const Q8Moments& state, int64_t step,
                   const AdamWOptions& options, const Tensor& param_copy = Tensor(),
                   uint64_t stochastic_rounding_seed = 0, uint64_t moment_seed = 0);

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

// clip_grad_norm_device without the scaling: the norm ([] f32) and the clip factor
// min(1, max_norm / (norm + 1e-6)) (1 when max_norm <= 0 or the norm is not finite), both on the
// gradients' device, no synchronisation; the gradients are left as they are. adamw_step with the
// factor as its grad_scale then equals clip_grad_norm_device followed by adamw_step, bit for bit.
// The factor is an f64 held as its 8 bytes in a [] i64 tensor (f64 tensors are CPU-only; the
// in-place scaling multiplies in f64, so an f32 factor would round differently); factor_value()
// reads it on the host (a synchronisation).
struct GradClip {
  Tensor norm, factor;
  double factor_value() const;
};
GradClip grad_clip_factor_device(const std::vector<Tensor>& grads, double max_norm);

}  // namespace kestrel
