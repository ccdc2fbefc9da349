// CUDA workspace sizes for the memory planner (see memory_plan_workspace.h for the files mirrored).
// The cross-entropy picker is a copy of the policy in ops/cuda/fused_linear_cross_entropy.cu, not a
// call into it: the planner runs in CPU-only builds too.
#include "memory_plan_workspace.h"

#include <algorithm>

namespace kestrel::train::plan_detail {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t m) { return ceil_div(a, m) * m; }
int64_t align256(int64_t x) { return round_up(x, 256); }

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kCrossEntropyBound = int64_t{1} << 30;  // ops/cuda/cross_entropy.cu kWorkspaceBound
constexpr int64_t kLtBytes = 32 * kMiB, kLtTightBytes = 4 * kMiB;
constexpr int64_t kTokenChunkAlign = 64, kMinGoodVocabChunk = 4096;

struct CeShape {
  int64_t tokens, vocab, elem;
  bool gradients;
};

// The launcher's workspace layout: cuBLASLt scratch, f32 logits [nc, vc], the kept row
// [nc, ld_store] (with gradients), three [nc, n_vchunks] f32 statistics, per-row scalars, per-token loss.
int64_t ce_layout(const CeShape& p, int64_t nc, int64_t vc, int64_t lt) {
  const int64_t n_vchunks = ceil_div(p.vocab, vc), ld_store = round_up(p.vocab, 8);
  int64_t total = align256(lt) + align256(nc * vc * 4);
  if (p.gradients) total += align256(nc * ld_store * p.elem);
  total += 3 * align256(nc * n_vchunks * 4) + align256(nc * 4) + align256(nc * 16) + align256(p.tokens * 4) +
           align256(4);
  return total;
}

int64_t vocab_chunk_for(int64_t vocab, int64_t requested) {
  const int64_t padded = round_up(vocab, 8);
  const int64_t vc = round_up(std::min(requested, padded), 8);
  return round_up(ceil_div(vocab, ceil_div(vocab, vc)), 8);
}

int64_t largest_fitting_token_chunk(const CeShape& p, int64_t vc, int64_t lt) {
  if (ce_layout(p, 1, vc, lt) > kCrossEntropyBound) return 0;
  int64_t lo = 1, hi = p.tokens;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (ce_layout(p, mid, vc, lt) <= kCrossEntropyBound) lo = mid; else hi = mid - 1;
  }
  return lo;
}

}  // namespace

int64_t cuda_context_workspace_bytes() { return 32 * kMiB; }

int64_t cuda_block_bytes(int64_t bytes) { return bytes <= 0 ? 0 : round_up(bytes, 512); }

int64_t cuda_cross_entropy_workspace_bytes(int64_t tokens, int64_t vocab, DType dtype, bool gradients) {
  const CeShape p{tokens, vocab, dtype == DType::F32 ? 4 : 2, gradients};
  // Preference (as the launcher's picker): a vocab chunk of at least 4096 (or all of V), then the
  // fewest token chunks, then the full cuBLASLt workspace.
  int64_t best_nc = 0, best_vc = 0, best_lt = 0, best_chunks = 0;
  bool best_small = true;
  for (int64_t requested : {16384, 8192, 4096, 2048, 1024, 512, 256, 128, 64, 8}) {
    const int64_t vc = vocab_chunk_for(vocab, requested);
    const bool small = requested < kMinGoodVocabChunk && vc < round_up(vocab, 8);
    for (int64_t lt : {kLtBytes, kLtTightBytes}) {
      const int64_t nc_max = largest_fitting_token_chunk(p, vc, lt);
      if (nc_max == 0) continue;
      const int64_t n_chunks = ceil_div(tokens, nc_max);
      const int64_t balanced = ceil_div(tokens, n_chunks);
      const int64_t rounded = std::min(round_up(balanced, kTokenChunkAlign), tokens);
      const int64_t nc = rounded <= nc_max ? rounded : balanced;
      if (best_chunks == 0 || (best_small && !small) || (small == best_small && n_chunks < best_chunks)) {
        best_nc = nc, best_vc = vc, best_lt = lt, best_chunks = n_chunks, best_small = small;
      }
    }
  }
  return best_chunks == 0 ? 0 : cuda_block_bytes(ce_layout(p, best_nc, best_vc, best_lt));
}

int64_t cuda_attention_backward_workspace_bytes(int64_t tokens, int64_t heads, int64_t head_dim) {
  const int64_t rows = tokens * heads;
  return cuda_block_bytes(align256(rows * head_dim * 4) + 2 * align256(rows * 4));
}

// ops/cuda/norm_backward.cu: G = min(rows, resident blocks) <= 8 per SM partial rows [G, C] f32 per
// weight-like gradient (rms_norm: dw; layer_norm: dw, db), then ops/cuda/column_sum.cu reduces them
// with a [slabs, C] f32 partial (slabs <= G / 32) while they are alive. An upper bound: the kernel's
// residency (2-8 blocks per SM) is a property of its register use, not of the shape.
int64_t cuda_norm_backward_workspace_bytes(int64_t rows, int64_t channels, int vectors) {
  constexpr int64_t kSms = 132, kMaxBlocksPerSm = 8, kColumnSumRowsPerSlab = 8 * 4;
  const int64_t g = std::min<int64_t>(rows, kSms * kMaxBlocksPerSm);
  const int64_t slabs = g / kColumnSumRowsPerSlab;
  return vectors * cuda_block_bytes(g * channels * 4) + (slabs > 1 ? cuda_block_bytes(slabs * channels * 4) : 0);
}

int64_t cuda_cross_entropy_backward_workspace_bytes(int64_t tokens, int64_t vocab, int64_t hidden, DType dtype) {
  // backward_layout of ops/cuda/fused_linear_cross_entropy_backward.cu: vocabulary chunks of about 8192
  // rows, a token chunk bounded by 768 MiB of logits + gradient, the coefficients, an f32 d_hidden for
  // 16-bit inputs and, when the tokens take several chunks, one f32 [vc, H] block for d_weight.
  const int64_t elem = dtype == DType::F32 ? 4 : 2;
  const int64_t vc = round_up(ceil_div(vocab, ceil_div(vocab, 8192)), 8);
  const int64_t fit = std::max<int64_t>(64, (768 * kMiB / (vc * (4 + elem))) / 64 * 64);
  const int64_t nc = std::min(tokens, fit);
  int64_t total = align256(kLtBytes) + align256(nc * vc * 4) + align256(nc * vc * elem) + align256(16 * tokens) +
                  align256(4);
  if (dtype != DType::F32) total += align256(tokens * hidden * 4);
  if (dtype != DType::F32 && nc < tokens) total += align256(vc * hidden * 4);
  return cuda_block_bytes(total);
}

}  // namespace kestrel::train::plan_detail
