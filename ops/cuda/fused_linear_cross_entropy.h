// Fused linear + cross-entropy on CUDA, over raw device pointers (private API; the Tensor-level op
// in ops/include wires it up).
//
// loss = reduce_i c_i * [ (1-eps) * (lse_i - x_i.w_{y_i}) + eps * (lse_i - mean_j x_i.w_j) + z * lse_i^2 ]
// with logits l_ij = x_i . w_j, lse_i = log sum_j exp(l_ij), over tokens i whose label y_i is not
// ignore_index. The full [N, V] logits never exist: tokens are processed in chunks of Nc rows and each
// chunk's logits are produced vocab chunk by vocab chunk (Vc columns, f32, cuBLASLt), reduced to
// per-(row, vocab chunk) max / sum-exp / logit-sum (a two-level log-sum-exp) and, when gradients are
// asked for, kept as 16-bit "logit minus chunk max" for the whole row. After the last vocab chunk the row
// statistics give lse, the loss terms and the coefficients of dloss/dlogits; the kept row is turned in
// place into G = dloss/dlogits (dtype of the inputs) and folded straight into
//   d_hidden[chunk] = G W            (one GEMM, K = V, written in the hidden dtype)
//   d_weight      (+)= G^T X[chunk]  (one GEMM, K = Nc, f32, beta = 1 after the first chunk)
// so loss + both gradients cost three GEMMs, not four (no recomputation of the logits).
//
// No host synchronisation anywhere: every result, including the error flag, stays on the device and the
// whole call can be captured in a CUDA graph (the tests do).
//
// Labels: int64. A label equal to ignore_index contributes nothing. Any other label outside [0, V) is an
// error: the token is treated as ignored and bit kLabelOutOfRange is OR-ed into *error_flag (an int on
// the device, when given). The flag is sticky: the launcher never clears it, the caller zeroes it once
// and reads it whenever convenient (e.g. with the loss, every K steps).
//
// Reduction mean: sum_i w_i loss_i / sum_i w_i over non-ignored tokens (w_i = 1 without token weights);
// when that denominator is 0 (all ignored) loss = 0 and gradients are 0. Reduction sum: sum_i w_i loss_i.
// Gradients are for an upstream gradient of 1, or of *upstream_grad (a device scalar) when given;
// scale_by_device_scalar can also apply it afterwards without a sync (not with accumulate_d_weight).
//
// Workspace (caller supplied, 256-byte aligned): fused_linear_cross_entropy_workspace_bytes(params).
// Roughly Nc*V*2 bytes (kept row, 16-bit; 4 bytes for f32 inputs; only with gradients) + Nc*Vc*4 (f32
// logits of one vocab chunk) + 32 MiB (cuBLASLt) + O(N). N = 8192, V = 250k: 1.47 GiB at Nc = 2752.
// pick_fused_linear_cross_entropy_chunks picks Nc, Vc under a byte bound (measured: 85-89 ms at 1.5 GiB,
// 87 ms at 1 GiB on an H200, PyTorch's plain linear + CE 93-98 ms and 26.7 GiB; bench/notes/).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "kestrel/runtime/dtype.h"

namespace kestrel::cuda {

enum class CrossEntropyReduction : uint8_t { Mean, Sum };

// Bits OR-ed into *error_flag.
inline constexpr int kLabelOutOfRange = 1;

struct FusedLinearCrossEntropyParams {
  DType dtype = DType::BF16;  // of hidden and weight: BF16, F16 or F32
  int64_t tokens = 0;         // N
  int64_t hidden = 0;         // H
  int64_t vocab = 0;          // V

  const void* hidden_states = nullptr;  // [N, H] dtype, row-major
  const void* weight = nullptr;         // [V, H] dtype, row-major
  const int64_t* labels = nullptr;      // [N]
  const float* token_weights = nullptr;  // [N] f32 or null (all 1)
  int64_t ignore_index = -100;
  CrossEntropyReduction reduction = CrossEntropyReduction::Mean;
  float z_loss = 0.0f;           // adds z * lse^2 per token
  float label_smoothing = 0.0f;  // eps in [0, 1]

  float* loss = nullptr;       // [1] f32, required
  float* lse = nullptr;        // [N] f32, optional (every token, ignored ones too)
  void* d_hidden = nullptr;    // [N, H] dtype, optional: overwritten
  void* d_weight = nullptr;    // [V, H], optional: f32, or `dtype` when d_weight_f32 is false
  // false: d_weight is in `dtype`: each token chunk's GEMM accumulates in f32 and adds its part into
  // d_weight with one rounding (one rounding in all when the tokens are one chunk; the training op's
  // single pass, ops/cuda/cross_entropy.cu, takes that for the f32 [V, H] buffer it saves).
  bool d_weight_f32 = true;
  bool accumulate_d_weight = false;  // false: d_weight = grad; true: d_weight += grad
  int* error_flag = nullptr;   // [1] int, optional, OR-ed with kLabel* bits
  // [1] f32 on the device, optional: gradients are computed for this upstream gradient instead of 1
  // (folded into dloss/dlogits, so accumulate_d_weight stays correct; the loss itself is not scaled).
  const float* upstream_grad = nullptr;

  // Chunking. All 0: pick_fused_linear_cross_entropy_chunks with a 1 GiB bound. token_chunk and/or
  // vocab_chunk set: used as given (Vc rounded up to a multiple of 8), the other one defaulted.
  int64_t token_chunk = 0;           // Nc
  int64_t vocab_chunk = 0;           // Vc
  size_t gemm_workspace_bytes = 0;   // cuBLASLt's share of the workspace; 0 = 32 MiB

  bool wants_gradients() const { return d_hidden != nullptr || d_weight != nullptr; }
};

struct FusedCrossEntropyChunks {
  int64_t token_chunk = 0;
  int64_t vocab_chunk = 0;
  size_t gemm_workspace_bytes = 0;
  void apply_to(FusedLinearCrossEntropyParams& p) const {
    p.token_chunk = token_chunk;
    p.vocab_chunk = vocab_chunk;
    p.gemm_workspace_bytes = gemm_workspace_bytes;
  }
};

// Chunk sizes actually used for params (resolves 0 = default, clamps to N and V, rounds Vc to 8).
FusedCrossEntropyChunks resolve_fused_linear_cross_entropy_chunks(const FusedLinearCrossEntropyParams& p);

// Chunks whose workspace is at most max_workspace_bytes (throws if even the smallest chunking does not
// fit): a vocab chunk of at least 4096 (all of V when smaller), then the fewest token chunks, then the full
// 32 MiB for cuBLASLt (4 MiB when that saves a token chunk). Apply with chunks.apply_to(params).
FusedCrossEntropyChunks pick_fused_linear_cross_entropy_chunks(const FusedLinearCrossEntropyParams& p,
                                                               size_t max_workspace_bytes);

// Bytes of workspace the launcher needs for params (with its chunk sizes resolved).
size_t fused_linear_cross_entropy_workspace_bytes(const FusedLinearCrossEntropyParams& p);

// Loss (+ lse, + gradients when asked) on `stream`, no host synchronisation. `workspace` must hold
// fused_linear_cross_entropy_workspace_bytes(p) bytes and be 256-byte aligned; it is scratch only
// (no state survives the call). cuBLASLt plans are chosen with the heuristic once per shape and cached.
void fused_linear_cross_entropy(const FusedLinearCrossEntropyParams& p, void* workspace,
                                size_t workspace_bytes, cublasLtHandle_t lt, cudaStream_t stream);

// Gradients only (d_hidden and/or d_weight, for p.upstream_grad or 1) from the forward's lse [N] f32,
// one vocabulary chunk at a time (fused_linear_cross_entropy_backward.cu): the workspace is one
// [nc, 8192] f32 logits block and its gradient (nc up to ~16k tokens at 768 MiB), an f32 [N, H]
// d_hidden accumulator for 16-bit inputs, and, only when the tokens need several chunks and d_weight is
// 16-bit, one [8192, H] f32 block. d_weight may be in the input dtype (d_weight_f32 false) at any
// token count; with accumulate_d_weight the gradient is added into it. p.loss is not used.
size_t fused_linear_cross_entropy_backward_workspace_bytes(const FusedLinearCrossEntropyParams& p);
void fused_linear_cross_entropy_backward(const FusedLinearCrossEntropyParams& p, const float* lse, void* workspace,
                                         size_t workspace_bytes, cublasLtHandle_t lt, cudaStream_t stream);

// data[0..n) *= *scalar (scalar on the device), for F32, BF16 or F16 data. Used by autograd to apply the
// upstream gradient to d_hidden / d_weight without a sync.
void scale_by_device_scalar(void* data, DType dtype, size_t n, const float* scalar, cudaStream_t stream);

}  // namespace kestrel::cuda
