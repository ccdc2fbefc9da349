// Workspace sizing rules of the CUDA kernels (see workspace_sizes.h): the launchers and the memory
// planner both call these, so a change here changes both.
#include "kestrel/ops/workspace_sizes.h"

#include <algorithm>

#include "kestrel/runtime/error.h"

namespace kestrel::workspace {
namespace {

constexpr const char* kCrossEntropyOp = "fused_linear_cross_entropy";
constexpr int64_t kDefaultVocabChunk = 16384;
constexpr int64_t kTokenChunkAlign = 64;
constexpr int64_t kMinGoodVocabChunk = 4096;
constexpr int64_t kBackwardVocabChunk = 8192;             // logits GEMMs of [nc, 8192]: full-machine GEMMs
constexpr size_t kBackwardBlockBound = size_t{768} << 20;  // the backward's logits + gradient block

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t m) { return ceil_div(a, m) * m; }
size_t align256(size_t x) { return (x + 255) / 256 * 256; }
size_t elem_bytes(DType t) { return t == DType::F32 ? 4 : 2; }

// Hands out 256-byte aligned offsets in order.
struct Carver {
  size_t off = 0;
  size_t take(size_t bytes) {
    const size_t at = off;
    off += align256(bytes);
    return at;
  }
};

void check_shape(const FusedCrossEntropyShape& s) {
  KESTREL_CHECK(s.dtype == DType::BF16 || s.dtype == DType::F16 || s.dtype == DType::F32, kCrossEntropyOp,
                "dtype must be bf16, f16 or f32, got ", dtype_name(s.dtype));
  KESTREL_CHECK(s.tokens >= 1 && s.hidden >= 1 && s.vocab >= 1, kCrossEntropyOp,
                "need tokens, hidden, vocab >= 1, got N=", s.tokens, " H=", s.hidden, " V=", s.vocab);
  KESTREL_CHECK(s.token_chunk >= 0 && s.vocab_chunk >= 0, kCrossEntropyOp, "chunk sizes must be >= 0 (0 = default)");
}

// Vocab chunk as asked (rounded to 8), or the default split into balanced chunks.
int64_t vocab_chunk_for(const FusedCrossEntropyShape& s, int64_t requested, bool balance) {
  const int64_t padded_v = round_up(s.vocab, 8);
  int64_t vc = round_up(std::min(requested, padded_v), 8);
  if (balance) vc = round_up(ceil_div(s.vocab, ceil_div(s.vocab, vc)), 8);
  return vc;
}

// Largest nc in [1, N] whose workspace fits (0 if none): the workspace grows with nc.
int64_t largest_fitting_token_chunk(const FusedCrossEntropyShape& s, int64_t vc, size_t lt_bytes, size_t bound) {
  if (fused_cross_entropy_layout(s, 1, vc, lt_bytes).total > bound) return 0;
  int64_t lo = 1, hi = s.tokens;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (fused_cross_entropy_layout(s, mid, vc, lt_bytes).total <= bound) lo = mid; else hi = mid - 1;
  }
  return lo;
}

}  // namespace

FusedCrossEntropyLayout fused_cross_entropy_layout(const FusedCrossEntropyShape& s, int64_t nc, int64_t vc,
                                                   size_t lt_bytes) {
  FusedCrossEntropyLayout l;
  l.lt_bytes = lt_bytes;
  l.nc = nc;
  l.vc = vc;
  l.n_vchunks = ceil_div(s.vocab, vc);
  l.ld_store = round_up(s.vocab, 8);  // 16-byte aligned rows for cuBLASLt and the vector kernels
  const size_t stats = size_t(nc) * size_t(l.n_vchunks) * 4;
  Carver c;
  l.lt = c.take(lt_bytes);
  l.logits = c.take(size_t(nc) * size_t(vc) * 4);  // [nc, vc] f32
  l.store = s.wants_gradients() ? c.take(size_t(nc) * size_t(l.ld_store) * elem_bytes(s.dtype)) : 0;  // [nc, ld_store]
  l.pmax = c.take(stats);  // [nc, n_vchunks]
  l.psum = c.take(stats);
  l.plsum = c.take(stats);
  l.label_logit = c.take(size_t(nc) * 4);      // [nc]
  l.row_coef = c.take(size_t(nc) * 4 * 4);     // [4, nc]
  l.token_loss = c.take(size_t(s.tokens) * 4);  // [N]
  l.weight_sum = c.take(4);
  l.total = c.off;
  return l;
}

FusedCrossEntropyChunks pick_fused_cross_entropy_chunks(const FusedCrossEntropyShape& s, size_t bound) {
  check_shape(s);
  static constexpr int64_t kCandidates[] = {16384, 8192, 4096, 2048, 1024, 512, 256, 128, 64, 8};
  // Preference: a vocab chunk of at least kMinGoodVocabChunk (or all of V) so every logits GEMM stays
  // large, then the fewest token chunks (each costs one more f32 read-modify-write of d_weight), then the
  // full cuBLASLt workspace. Measured at V = 250k, N = 8192 (bench/notes/fused_linear_cross_entropy.md):
  // Vc = 4096 and Vc = 15632 run alike, Vc = 1024 loses 9%, one token chunk more costs about 5%.
  FusedCrossEntropyChunks best;
  int64_t best_chunks = 0;
  bool best_small = true;
  const size_t lt_options[2] = {s.gemm_workspace_bytes ? s.gemm_workspace_bytes : kCublasLtWorkspaceBytes,
                                s.gemm_workspace_bytes ? s.gemm_workspace_bytes : kCublasLtWorkspaceTightBytes};
  for (int64_t requested : kCandidates) {
    if (s.vocab_chunk > 0) requested = s.vocab_chunk;
    const int64_t vc = vocab_chunk_for(s, requested, s.vocab_chunk == 0);
    const bool small = requested < kMinGoodVocabChunk && vc < round_up(s.vocab, 8);  // before balancing
    for (size_t lt_bytes : lt_options) {
      const int64_t nc_max = largest_fitting_token_chunk(s, vc, lt_bytes, bound);
      if (nc_max == 0) continue;
      // As few token chunks as fit, then equal ones, rounded up to a GEMM-friendly multiple when that fits.
      const int64_t n_chunks = ceil_div(s.tokens, nc_max);
      const int64_t balanced = ceil_div(s.tokens, n_chunks);
      const int64_t rounded = std::min(round_up(balanced, kTokenChunkAlign), s.tokens);
      const int64_t nc = rounded <= nc_max ? rounded : balanced;
      if (best_chunks == 0 || (best_small && !small) || (small == best_small && n_chunks < best_chunks)) {
        best = {nc, vc, lt_bytes};
        best_chunks = n_chunks;
        best_small = small;
      }
    }
    if (s.vocab_chunk > 0) break;
  }
  KESTREL_CHECK(best_chunks > 0, kCrossEntropyOp, "no chunking fits a workspace of ", bound, " bytes (N=", s.tokens,
                " V=", s.vocab, "; the smallest needs ", fused_cross_entropy_layout(s, 1, 8, lt_options[1]).total, ")");
  return best;
}

FusedCrossEntropyChunks resolve_fused_cross_entropy_chunks(const FusedCrossEntropyShape& s) {
  check_shape(s);
  const size_t lt_bytes = s.gemm_workspace_bytes ? s.gemm_workspace_bytes : kCublasLtWorkspaceBytes;
  if (s.token_chunk > 0 && s.vocab_chunk > 0)
    return {std::min(s.token_chunk, s.tokens), vocab_chunk_for(s, s.vocab_chunk, false), lt_bytes};
  if (s.token_chunk > 0)
    return {std::min(s.token_chunk, s.tokens), vocab_chunk_for(s, kDefaultVocabChunk, true), lt_bytes};
  return pick_fused_cross_entropy_chunks(s, kFusedCrossEntropyBound);
}

FusedCrossEntropyLayout resolved_fused_cross_entropy_layout(const FusedCrossEntropyShape& s) {
  const FusedCrossEntropyChunks c = resolve_fused_cross_entropy_chunks(s);
  return fused_cross_entropy_layout(s, c.token_chunk, c.vocab_chunk, c.gemm_workspace_bytes);
}

FusedCrossEntropyBackwardLayout fused_cross_entropy_backward_layout(const FusedCrossEntropyShape& s) {
  FusedCrossEntropyBackwardLayout l;
  const size_t elem = elem_bytes(s.dtype);
  const int64_t n_v = ceil_div(s.vocab, s.vocab_chunk > 0 ? s.vocab_chunk : kBackwardVocabChunk);
  l.vc = round_up(ceil_div(s.vocab, n_v), 8);
  const int64_t fit =
      std::max<int64_t>(64, static_cast<int64_t>(kBackwardBlockBound / (size_t(l.vc) * (4 + elem))) / 64 * 64);
  l.nc = std::min(s.tokens, s.token_chunk > 0 ? s.token_chunk : fit);
  const bool one_chunk = l.nc >= s.tokens;
  l.dh_f32_scratch = s.d_hidden && s.dtype != DType::F32;
  l.dw_f32_scratch = s.d_weight && !s.d_weight_f32 && !one_chunk;
  l.lt_bytes = s.gemm_workspace_bytes ? s.gemm_workspace_bytes : kCublasLtWorkspaceBytes;
  Carver c;
  l.lt = c.take(l.lt_bytes);
  l.logits = c.take(size_t(l.nc) * size_t(l.vc) * 4);   // [nc, vc] f32
  l.grad = c.take(size_t(l.nc) * size_t(l.vc) * elem);  // [nc, vc] dtype
  l.coef = c.take(size_t(4) * size_t(s.tokens) * 4);   // [4, N]
  l.weight_sum = c.take(4);
  if (l.dh_f32_scratch) l.dh32 = c.take(size_t(s.tokens) * size_t(s.hidden) * 4);  // [N, H] f32
  if (l.dw_f32_scratch) l.dw32 = c.take(size_t(l.vc) * size_t(s.hidden) * 4);      // [vc, H] f32
  l.total = c.off;
  return l;
}

AttentionBackwardLayout attention_backward_layout(int64_t total_q, int64_t heads_q, int64_t head_dim,
                                                  bool deterministic) {
  const size_t rows = static_cast<size_t>(total_q) * static_cast<size_t>(heads_q);
  AttentionBackwardLayout l;
  Carver c;
  l.dq_accum = c.take(rows * static_cast<size_t>(head_dim) * sizeof(float));  // [total_q, Hq, D] f32
  l.lse2 = c.take(rows * sizeof(float));                                     // [Hq, total_q]
  l.delta = c.take(rows * sizeof(float));                                    // [Hq, total_q]
  if (deterministic) l.dq_order = c.take(rows * sizeof(int32_t));            // [Hq, total_q] i32
  l.total = c.off;
  return l;
}

int64_t norm_backward_max_partial_rows(int64_t rows, int64_t sm_count) {
  return std::min<int64_t>(rows, sm_count * kNormBackwardMaxBlocksPerSm);
}

}  // namespace kestrel::workspace
