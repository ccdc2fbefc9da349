// How the CUDA kernels size their workspaces, as plain functions with no CUDA dependency (the pattern
// of runtime/src/caching_allocator_policy.h). The kernels' launchers (ops/cuda) carve their
// workspaces from these layouts and the memory planner (train/src/memory_plan_workspace.cpp) sizes
// the same buffers with them, so the two cannot drift apart. CPU-only builds compile and test them.
//
// Covered:
//   - the fused linear + cross-entropy forward: the chunk picker (token chunk, vocabulary chunk and
//     cuBLASLt share under a byte bound) and its workspace layout (fused_linear_cross_entropy.cu);
//   - its lse-based backward's layout (fused_linear_cross_entropy_backward.cu);
//   - the flash attention backward's layout (ops/cuda/flash_attention/bwd_launch.cu);
//   - the bound on the norm backward's partial rows (norm_backward.cu).
// Byte counts are of the workspace itself; the allocator's rounding is the caller's business.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kestrel/runtime/dtype.h"

namespace kestrel::workspace {

// ---- fused linear + cross-entropy ----
inline constexpr size_t kFusedCrossEntropyBound = size_t{1} << 30;     // the op's forward workspace bound
inline constexpr size_t kCublasLtWorkspaceBytes = size_t{32} << 20;    // cuBLASLt's recommended share on Hopper
inline constexpr size_t kCublasLtWorkspaceTightBytes = size_t{4} << 20;  // when 28 MiB more buys a token chunk

// What sizes the fused cross-entropy's workspaces: the shape, the gradients asked for and the chunking
// (0 = the default: picked by the forward's picker, 8192-row vocabulary chunks in the backward).
struct FusedCrossEntropyShape {
  DType dtype = DType::BF16;  // of hidden and weight: BF16, F16 or F32
  int64_t tokens = 0, hidden = 0, vocab = 0;
  bool d_hidden = false, d_weight = false;
  bool d_weight_f32 = true;  // d_weight in f32 (else in `dtype`)
  int64_t token_chunk = 0, vocab_chunk = 0;
  size_t gemm_workspace_bytes = 0;  // cuBLASLt's share; 0 = kCublasLtWorkspaceBytes
  bool wants_gradients() const { return d_hidden || d_weight; }
};

struct FusedCrossEntropyChunks {
  int64_t token_chunk = 0, vocab_chunk = 0;
  size_t gemm_workspace_bytes = 0;
};

// Byte offsets of every buffer of the forward's workspace (256-byte aligned), for nc tokens and vc
// vocabulary rows per chunk: cuBLASLt scratch, f32 logits [nc, vc], the kept row [nc, ld_store] (with
// gradients), three f32 statistics [nc, n_vchunks], per-row scalars, per-token loss.
struct FusedCrossEntropyLayout {
  int64_t nc = 0, vc = 0, n_vchunks = 0, ld_store = 0;
  size_t lt_bytes = 0;
  size_t lt = 0, logits = 0, store = 0, pmax = 0, psum = 0, plsum = 0, label_logit = 0, row_coef = 0,
         token_loss = 0, weight_sum = 0, total = 0;
};
FusedCrossEntropyLayout fused_cross_entropy_layout(const FusedCrossEntropyShape& s, int64_t nc, int64_t vc,
                                                   size_t lt_bytes);

// Chunks whose forward workspace is at most `bound` bytes (throws if even the smallest does not fit):
// a vocabulary chunk of at least 4096 rows (all of V when smaller), then the fewest token chunks,
// then the full 32 MiB for cuBLASLt (4 MiB when that saves a token chunk). s.vocab_chunk > 0 is kept.
FusedCrossEntropyChunks pick_fused_cross_entropy_chunks(const FusedCrossEntropyShape& s, size_t bound);
// The chunks the forward uses for `s` (its chunk fields resolved: 0 = default).
FusedCrossEntropyChunks resolve_fused_cross_entropy_chunks(const FusedCrossEntropyShape& s);
// The forward's layout with the chunks resolved.
FusedCrossEntropyLayout resolved_fused_cross_entropy_layout(const FusedCrossEntropyShape& s);

// The lse-based backward, per vocabulary chunk of about 8192 rows and token chunk bounded by 768 MiB
// of logits + gradient: cuBLASLt scratch, f32 logits [nc, vc], the gradient [nc, vc] (dtype), the
// coefficients [4, N], the weight sum, an f32 d_hidden [N, H] for 16-bit inputs, and, when the tokens
// take several chunks and d_weight is 16-bit, one f32 [vc, H] block.
struct FusedCrossEntropyBackwardLayout {
  int64_t nc = 0, vc = 0;
  size_t lt_bytes = 0;
  size_t lt = 0, logits = 0, grad = 0, coef = 0, weight_sum = 0, dh32 = 0, dw32 = 0, total = 0;
  bool dh_f32_scratch = false, dw_f32_scratch = false;
};
FusedCrossEntropyBackwardLayout fused_cross_entropy_backward_layout(const FusedCrossEntropyShape& s);

// ---- flash attention backward: f32 dq accumulator [total_q, Hq, D], lse2 and delta [Hq, total_q],
// and with `deterministic` the i32 dq ordering counters [Hq, total_q] ----
struct AttentionBackwardLayout {
  size_t dq_accum = 0, lse2 = 0, delta = 0, dq_order = 0, total = 0;
};
AttentionBackwardLayout attention_backward_layout(int64_t total_q, int64_t heads_q, int64_t head_dim,
                                                  bool deterministic = false);

// ---- norm backward: at most this many blocks per SM, so the f32 partial rows [G, C] per weight-like
// gradient stay within G <= rows and G <= 8 x SMs whatever the kernel's residency ----
inline constexpr int64_t kNormBackwardMaxBlocksPerSm = 8;
int64_t norm_backward_max_partial_rows(int64_t rows, int64_t sm_count);

}  // namespace kestrel::workspace
