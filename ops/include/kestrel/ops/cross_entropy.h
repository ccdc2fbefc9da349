// Cross-entropy losses. fused_linear_cross_entropy computes
//   loss = reduce_i w_i * [ (1-eps) * (lse_i - z_{i,y_i}) + eps * (lse_i - mean_j z_ij) + z_loss * lse_i^2 ]
// with z = hidden @ weight^T, without ever holding the [N, V] logits: the CPU reference walks
// chunks of tokens and vocabulary with an online log-sum-exp; the CUDA version chunks GEMMs through
// cuBLASLt. Labels equal to ignore_index contribute nothing; mean divides by sum of w_i over the
// non-ignored tokens (w_i = 1 when no token weights are given); a mean over zero tokens is 0.
#pragma once

#include "kestrel/runtime/tensor.h"

namespace kestrel {

enum class Reduction { Mean, Sum };

struct CrossEntropyOptions {
  int64_t ignore_index = -100;
  Reduction reduction = Reduction::Mean;
  double z_loss = 0.0;           // coefficient of lse^2
  double label_smoothing = 0.0;  // eps
  int64_t chunk_tokens = 0;      // 0 = automatic
  int64_t chunk_vocab = 0;       // 0 = automatic
  // The loss's gradient when the caller knows it before the forward (the training step's backward seed):
  // a scalar floating tensor on the inputs' device. A recording call then computes both gradients in the
  // forward, for this upstream gradient, through the kernels' fused_linear_cross_entropy_forward_backward
  // (on CUDA one pass of three GEMMs instead of the forward's logits GEMM plus a backward that recomputes
  // them): d_hidden is held for the backward, and d_weight is added into the weight's gradient right away
  // when it holds one (else held too). The backward must then receive this very tensor as the loss's
  // gradient; any other gradient is refused by name (the weight's gradient already holds this one's part).
  // A 16-bit d_weight is rounded once per token chunk of the CUDA pass instead of once. Undefined: the
  // gradients are computed in the backward from the saved log-sum-exp.
  Tensor known_grad;
};

// hidden [N, H], weight [V, H] (same dtype), labels [N] (i64/i32; out of range -> error),
// token_weights [N] f32 or undefined. Returns a scalar f32 loss (f64 for f64 inputs, which the
// gradient checker uses); differentiable in hidden and weight.
Tensor fused_linear_cross_entropy(const Tensor& hidden, const Tensor& weight, const Tensor& labels,
                                  const Tensor& token_weights = Tensor(), const CrossEntropyOptions& options = {});

// The same loss from materialised logits [N, V] (composed of ordinary ops: the test oracle).
Tensor cross_entropy(const Tensor& logits, const Tensor& labels, const Tensor& token_weights = Tensor(),
                     const CrossEntropyOptions& options = {});

}  // namespace kestrel
