// Private: optimizer kernel slots. Multi-tensor by design: a CUDA kernel can update every parameter
// of a group (or sum every gradient's squares) in one launch. The op layer (src/optim.cpp) checks
// shapes/dtypes/devices once; every tensor here is contiguous and on one device.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/registry.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::kernels {

struct AdamWTensors {
  Tensor param;       // master parameter, f32 (f64 accepted on the CPU), or bf16/f16 without a master
                      // (then no param_copy: param itself is rounded by the seed), updated in place
  Tensor grad;        // any floating dtype, same shape
  Tensor m, v;        // moments, param's dtype, updated in place
  Tensor param_copy;  // undefined, or bf16/f16/f32 of the same shape: receives the updated param
  // 0: param_copy rounded to nearest even. Otherwise stochastic rounding: element i rounds up with
  // probability (x - lo) / (hi - lo), compared with philox_uniform(seed, 0, i) (see philox.h).
  uint64_t stochastic_rounding_seed = 0;
  // Undefined, or the clip factor of clip_by_global_norm's `factor` (an f64 in a [] i64 slot) on the
  // parameter's device: the gradient is first multiplied by it and rounded to its dtype as scale_in_place
  // rounds on that device, so the step equals scaling the gradient in place and then stepping.
  Tensor grad_scale;
};

// adamw_step_q8: the moments as 8-bit codes and per-block f32 scales (kestrel/ops/adamw_q8.h). param:
// f32 master (optional 16-bit copy) or a bf16/f16 parameter updated in place.
struct AdamWQ8Tensors {
  Tensor param, grad, param_copy;
  Tensor m_codes, v_codes;  // u8 [n]
  Tensor m_scale, v_scale;  // f32 [ceil(n / 2048)]
  uint64_t stochastic_rounding_seed = 0;  // the parameter (or copy): as AdamWTensors
  uint64_t moment_seed = 0;               // the codes: stochastic rounding; 0 = nearest
};

struct AdamWHyper {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  int64_t step = 1;  // counted from 1 (bias correction)
};

using AdamWFn = void(const std::vector<AdamWTensors>& tensors, const AdamWHyper& h);
using AdamWQ8Fn = void(const std::vector<AdamWQ8Tensors>& tensors, const AdamWHyper& h);
// Sum over all tensors of sum(x^2), accumulated in f64 (returned to the host).
using SumSquaresFn = double(const std::vector<Tensor>& tensors);
// x *= s for every tensor, in place.
using ScaleInPlaceFn = void(const std::vector<Tensor>& tensors, double s);

// Global-norm clipping without a host round trip: norm ([] f32, on the tensors' device) = sqrt of
// the sum of squares (f64 accumulation); when max_norm > 0 and the norm is finite, every tensor is
// scaled in place by min(1, max_norm / (norm + 1e-6)), the factor computed and read on the device.
// With `factor` defined (an f64 in a [] i64 slot on the device) the factor (1 when nothing would be scaled) is written
// there instead and the tensors are left as they are (AdamWTensors::grad_scale applies it).
using ClipByGlobalNormFn = void(const std::vector<Tensor>& tensors, const Tensor& norm, double max_norm,
                                const Tensor& factor);

inline KernelSlot<AdamWFn> adamw;
inline KernelSlot<AdamWQ8Fn> adamw_q8;
inline KernelSlot<ClipByGlobalNormFn> clip_by_global_norm;
inline KernelSlot<SumSquaresFn> sum_squares;
inline KernelSlot<ScaleInPlaceFn> scale_in_place;

}  // namespace kestrel::kernels
