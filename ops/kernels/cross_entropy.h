// Private: fused linear + cross-entropy kernel slots. Forward returns the loss and the per-token
// log-sum-exp; backward recomputes the logits chunk by chunk from the saved lse (the CPU reference),
// or - for a device kernel that produces gradients in one fused pass, like cuda/fused_linear_cross_
// entropy.h - may simply rerun that pass with grad_loss as its upstream gradient.
//
// The op layer (src/cross_entropy.cpp) hands kernels contiguous hidden [N, H] and weight [V, H] of one
// floating dtype, labels as contiguous i64 [N] (already range-checked on the CPU), token_weights as
// contiguous f32 [N] (f64 for f64 inputs) or undefined, and the resolved chunk sizes.
#pragma once

#include <cstdint>

#include "kernels/registry.h"
#include "kestrel/ops/cross_entropy.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::kernels {

struct CrossEntropyParams {
  int64_t ignore_index = -100;
  Reduction reduction = Reduction::Mean;
  double z_loss = 0.0;
  double label_smoothing = 0.0;
  int64_t chunk_tokens = 0;  // resolved: 1..N
  int64_t chunk_vocab = 0;   // resolved: 1..V
  // Backward: add the weight gradient into d_weight (which holds a gradient already) instead of
  // overwriting it; the sum is formed in the compute dtype and rounded once.
  bool accumulate_d_weight = false;
};

// loss: [] f32 (f64 for f64 inputs); lse: [N] same dtype as loss, for every token (ignored ones too).
using FusedLinearCrossEntropyForwardFn = void(const Tensor& loss, const Tensor& lse, const Tensor& hidden,
                                              const Tensor& weight, const Tensor& labels,
                                              const Tensor& token_weights, const CrossEntropyParams& p);
// d_hidden [N, H] (hidden's dtype) and d_weight [V, H] (weight's dtype), either undefined when not
// wanted, are overwritten with the gradients of grad_loss ([] scalar on the device) * loss.
using FusedLinearCrossEntropyBackwardFn = void(const Tensor& d_hidden, const Tensor& d_weight,
                                               const Tensor& grad_loss, const Tensor& hidden, const Tensor& weight,
                                               const Tensor& labels, const Tensor& token_weights, const Tensor& lse,
                                               const CrossEntropyParams& p);

// Loss and both gradients in one call, for an upstream gradient known before the forward (the training
// step's: the op's CrossEntropyOptions::known_grad). loss as the forward's; d_hidden / d_weight as the
// backward's (either undefined when not wanted; accumulate_d_weight adds into d_weight). On CUDA one
// pass of three GEMMs (the logits are not recomputed; a 16-bit d_weight is rounded once per token
// chunk); on the CPU the forward then the backward from its lse (the same results as calling them apart).
using FusedLinearCrossEntropyForwardBackwardFn = void(const Tensor& loss, const Tensor& d_hidden,
                                                      const Tensor& d_weight, const Tensor& grad_loss,
                                                      const Tensor& hidden, const Tensor& weight, const Tensor& labels,
                                                      const Tensor& token_weights, const CrossEntropyParams& p);

inline KernelSlot<FusedLinearCrossEntropyForwardFn> fused_linear_cross_entropy_forward;
inline KernelSlot<FusedLinearCrossEntropyForwardBackwardFn> fused_linear_cross_entropy_forward_backward;
inline KernelSlot<FusedLinearCrossEntropyBackwardFn> fused_linear_cross_entropy_backward;

}  // namespace kestrel::kernels
