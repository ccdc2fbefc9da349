// Internals of the fused linear + cross-entropy: the kernel launchers (fused_linear_cross_entropy_kernels.cu)
// and the cached cuBLASLt GEMM (fused_linear_cross_entropy_gemm.cu) that the launcher in
// fused_linear_cross_entropy.cu strings together. Not for use outside these files and their tests.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "cuda/fused_linear_cross_entropy.h"
#include "kestrel/ops/workspace_sizes.h"

namespace kestrel::cuda::fused_ce {

// What sizes the workspaces (kestrel/ops/workspace_sizes.h: the rules the memory planner uses too).
inline workspace::FusedCrossEntropyShape workspace_shape(const FusedLinearCrossEntropyParams& p) {
  workspace::FusedCrossEntropyShape s;
  s.dtype = p.dtype;
  s.tokens = p.tokens;
  s.hidden = p.hidden;
  s.vocab = p.vocab;
  s.d_hidden = p.d_hidden != nullptr;
  s.d_weight = p.d_weight != nullptr;
  s.d_weight_f32 = p.d_weight_f32;
  s.token_chunk = p.token_chunk;
  s.vocab_chunk = p.vocab_chunk;
  s.gemm_workspace_bytes = p.gemm_workspace_bytes;
  return s;
}

// ---- cuBLASLt GEMM, column-major as cuBLASLt sees it: D[m, n] = op(A)[m, k] op(B)[k, n] (+ beta D) ----
struct GemmDesc {
  cublasOperation_t trans_a = CUBLAS_OP_N;
  cublasOperation_t trans_b = CUBLAS_OP_N;
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldd = 0;
  cudaDataType_t ab_type = CUDA_R_16BF;  // A and B
  cudaDataType_t d_type = CUDA_R_32F;    // C and D
};

// Runs D = op(A) op(B) + beta * D with f32 accumulation. The algorithm comes from
// cublasLtMatmulAlgoGetHeuristic once per (handle, shape, types, pointer alignments, beta != 0) and is
// cached process-wide.
void lt_matmul(cublasLtHandle_t lt, const GemmDesc& g, const void* a, const void* b, void* d, float beta,
               void* lt_workspace, size_t lt_workspace_bytes, cudaStream_t stream);

// ---- kernels ----
// Checks labels, sums the token weights of non-ignored tokens into *weight_sum, ORs error bits.
void launch_prepare(const int64_t* labels, const float* token_weights, int64_t n, int64_t vocab,
                    int64_t ignore_index, float* weight_sum, int* error_flag, cudaStream_t stream);

// One vocab chunk of one token chunk: logits [nc, ld_logits] (vc valid columns, f32) ->
// row statistics at column `chunk` of pmax/psum/plsum [nc, n_vchunks], the f32 label logit when the
// label falls in [v0, v0 + vc), and (store != null) store[r, v0 + j] = logit - chunk max, 16-bit or f32.
struct ChunkStatsArgs {
  const float* logits = nullptr;  // [nc, ld_logits]
  int64_t ld_logits = 0;
  int64_t nc = 0, vc = 0, v0 = 0;
  int chunk = 0, n_vchunks = 0;
  const int64_t* labels = nullptr;  // [nc] (this token chunk)
  int64_t vocab = 0, ignore_index = 0;
  void* store = nullptr;  // [nc, ld_store] or null
  int64_t ld_store = 0;
  float* pmax = nullptr;   // [nc, n_vchunks]
  float* psum = nullptr;   // [nc, n_vchunks]
  float* plsum = nullptr;  // [nc, n_vchunks]
  float* label_logit = nullptr;  // [nc]
};
void launch_chunk_stats(const ChunkStatsArgs& a, DType dtype, cudaStream_t stream);

// After the last vocab chunk: lse, per-token weighted loss, and the coefficients of
// dloss/dlogit_j = a * p_j - e - [j == y] * b for each row of the token chunk.
struct RowFinalizeArgs {
  int64_t nc = 0, t0 = 0;
  int n_vchunks = 0;
  const int64_t* labels = nullptr;        // [N] (whole batch, indexed t0 + r)
  const float* token_weights = nullptr;   // [N] or null
  int64_t vocab = 0, ignore_index = 0;
  bool mean = true;
  float z_loss = 0, label_smoothing = 0;
  const float* weight_sum = nullptr;      // [1]
  const float* upstream_grad = nullptr;   // [1] or null
  const float* pmax = nullptr;            // [nc, n_vchunks]
  const float* psum = nullptr;
  const float* plsum = nullptr;
  const float* label_logit = nullptr;     // [nc]
  float* lse_out = nullptr;               // [N] or null
  float* token_loss = nullptr;            // [N]
  float* row_coef = nullptr;              // [4, nc]: a, b, e, lse
};
void launch_row_finalize(const RowFinalizeArgs& a, cudaStream_t stream);

// In place over store [nc, ld_store]: G[r, j] = a_r exp(s_rj + pmax[r, j / vc] - lse_r) - e_r - [j == y_r] b_r,
// written as bf16 (bf16 inputs), f16 (f16 inputs) or f32; columns in [vocab, ld_store) become 0.
struct FormGradArgs {
  void* store = nullptr;
  int64_t ld_store = 0, nc = 0, vocab = 0, vocab_chunk = 0;
  int n_vchunks = 0;
  const int64_t* labels = nullptr;  // [nc] (this token chunk)
  const float* pmax = nullptr;      // [nc, n_vchunks]
  const float* row_coef = nullptr;  // [4, nc]
};
void launch_form_grad(const FormGradArgs& a, DType dtype, cudaStream_t stream);

// Backward from the forward's lse: the coefficients of every token's row, [4, n] in row_coef's order.
struct LseCoefArgs {
  const int64_t* labels = nullptr;       // [n]
  const float* token_weights = nullptr;  // [n] or null
  const float* lse = nullptr;            // [n]
  const float* weight_sum = nullptr;     // [1], from launch_prepare
  const float* upstream_grad = nullptr;  // [1] or null
  int64_t n = 0, vocab = 0, ignore_index = 0;
  bool mean = true;
  float z_loss = 0.0f, label_smoothing = 0.0f;
  float* row_coef = nullptr;  // [4, n]
};
void launch_row_coef_from_lse(const LseCoefArgs& a, cudaStream_t stream);

// grad[r, j] = a_i exp(logits[r, j] - lse_i) - e_i - [v0 + j == y_i] b_i, i = t0 + r, for vc columns
// (f32 logits and the gradient in the input dtype, both [nc, ld]).
struct LseGradArgs {
  const float* logits = nullptr;
  void* grad = nullptr;
  int64_t ld = 0, nc = 0, vc = 0, v0 = 0, t0 = 0, n = 0;
  const int64_t* labels = nullptr;   // [n]
  const float* row_coef = nullptr;   // [4, n]
};
void launch_grad_from_lse(const LseGradArgs& a, DType dtype, cudaStream_t stream);

// dst[0..n) = round(src + (add ? dst : 0)) in dtype (f32 src).
void launch_store_f32(void* dst, DType dtype, const float* src, int64_t n, bool add, cudaStream_t stream);

// loss = sum(token_loss) / weight_sum (mean; 0 when weight_sum == 0) or sum(token_loss), fixed order.
void launch_final_loss(const float* token_loss, int64_t n, const float* weight_sum, bool mean, float* loss,
                       cudaStream_t stream);

}  // namespace kestrel::cuda::fused_ce
