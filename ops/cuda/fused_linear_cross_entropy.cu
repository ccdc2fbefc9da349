// Host side of the fused linear + cross-entropy: argument checks, chunk sizes, workspace layout and
// the launch sequence (see fused_linear_cross_entropy.h for the algorithm and its memory).
//
// Per token chunk [t0, t0 + nc):
//   for each vocab chunk [v0, v0 + vc):  logits = X_c W_v^T (cuBLASLt, f32 out)   -> chunk_stats
//   row_finalize (lse, loss terms, gradient coefficients)
//   with gradients: form_grad (in place: kept row -> G), d_hidden_c = G W, d_weight (+)= G^T X_c.
// Chunk policy: the kept row costs nc * V * 2 bytes, so nc is what the workspace bound buys; vc only sizes
// the f32 logits scratch and is kept large (16384) so each logits GEMM stays a full-machine GEMM.
#include <algorithm>
#include <cstdint>

#include "cuda/fused_linear_cross_entropy.h"
#include "cuda/fused_linear_cross_entropy_internal.h"
#include "kestrel/runtime/cuda_check.h"
#include "kestrel/runtime/error.h"

namespace kestrel::cuda {
namespace {

constexpr const char* kOp = "fused_linear_cross_entropy";
constexpr size_t kLtWorkspaceBytes = size_t(32) << 20;  // cuBLASLt's recommended workspace on Hopper
constexpr size_t kLtWorkspaceTightBytes = size_t(4) << 20;  // when 28 MiB more buys a token chunk
constexpr int64_t kDefaultVocabChunk = 16384;
constexpr size_t kDefaultWorkspaceBound = size_t(1) << 30;
constexpr int64_t kTokenChunkAlign = 64;
constexpr int64_t kMinGoodVocabChunk = 4096;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t m) { return ceil_div(a, m) * m; }
size_t align256(size_t x) { return (x + 255) / 256 * 256; }

size_t store_elem_bytes(DType t) { return t == DType::F32 ? 4 : 2; }

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::BF16: return CUDA_R_16BF;
    case DType::F16: return CUDA_R_16F;
    case DType::F32: return CUDA_R_32F;
    default: throw make_error(kOp, "dtype must be bf16, f16 or f32, got ", dtype_name(t));
  }
}

// Byte offsets of every buffer inside the workspace.
struct Layout {
  int64_t nc = 0, vc = 0, n_vchunks = 0, ld_store = 0;
  size_t lt_bytes = 0;
  size_t lt = 0, logits = 0, store = 0, pmax = 0, psum = 0, plsum = 0, label_logit = 0, row_coef = 0,
         token_loss = 0, weight_sum = 0, total = 0;
};

Layout make_layout(const FusedLinearCrossEntropyParams& p, int64_t nc, int64_t vc, size_t lt_bytes) {
  Layout l;
  l.lt_bytes = lt_bytes;
  l.nc = nc;
  l.vc = vc;
  l.n_vchunks = ceil_div(p.vocab, vc);
  l.ld_store = round_up(p.vocab, 8);  // 16-byte aligned rows for cuBLASLt and the vector kernels
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += align256(bytes);
    return at;
  };
  const size_t stats = size_t(nc) * size_t(l.n_vchunks) * 4;
  l.lt = take(lt_bytes);
  l.logits = take(size_t(nc) * size_t(vc) * 4);                   // [nc, vc] f32
  l.store = p.wants_gradients() ? take(size_t(nc) * size_t(l.ld_store) * store_elem_bytes(p.dtype)) : 0;  // [nc, ld_store]
  l.pmax = take(stats);                                           // [nc, n_vchunks]
  l.psum = take(stats);
  l.plsum = take(stats);
  l.label_logit = take(size_t(nc) * 4);                           // [nc]
  l.row_coef = take(size_t(nc) * 4 * 4);                          // [4, nc]
  l.token_loss = take(size_t(p.tokens) * 4);                      // [N]
  l.weight_sum = take(4);
  l.total = off;
  return l;
}

// Vocab chunk as asked (rounded to 8), or the default split into balanced chunks.
int64_t vocab_chunk_for(const FusedLinearCrossEntropyParams& p, int64_t requested, bool balance) {
  const int64_t padded_v = round_up(p.vocab, 8);
  int64_t vc = round_up(std::min(requested, padded_v), 8);
  if (balance) vc = round_up(ceil_div(p.vocab, ceil_div(p.vocab, vc)), 8);
  return vc;
}

// Largest nc in [1, N] whose workspace fits (0 if none): the workspace grows with nc.
int64_t largest_fitting_token_chunk(const FusedLinearCrossEntropyParams& p, int64_t vc, size_t lt_bytes,
                                    size_t bound) {
  if (make_layout(p, 1, vc, lt_bytes).total > bound) return 0;
  int64_t lo = 1, hi = p.tokens;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (make_layout(p, mid, vc, lt_bytes).total <= bound) lo = mid; else hi = mid - 1;
  }
  return lo;
}

void check_shape(const FusedLinearCrossEntropyParams& p) {
  KESTREL_CHECK(p.dtype == DType::BF16 || p.dtype == DType::F16 || p.dtype == DType::F32, kOp,
                "dtype must be bf16, f16 or f32, got ", dtype_name(p.dtype));
  KESTREL_CHECK(p.tokens >= 1 && p.hidden >= 1 && p.vocab >= 1, kOp, "need tokens, hidden, vocab >= 1, got N=",
                p.tokens, " H=", p.hidden, " V=", p.vocab);
  KESTREL_CHECK(p.token_chunk >= 0 && p.vocab_chunk >= 0, kOp, "chunk sizes must be >= 0 (0 = default)");
}

Layout resolved_layout(const FusedLinearCrossEntropyParams& p) {
  const auto c = resolve_fused_linear_cross_entropy_chunks(p);
  return make_layout(p, c.token_chunk, c.vocab_chunk, c.gemm_workspace_bytes);
}

}  // namespace

FusedCrossEntropyChunks pick_fused_linear_cross_entropy_chunks(const FusedLinearCrossEntropyParams& p,
                                                               size_t max_workspace_bytes) {
  check_shape(p);
  static constexpr int64_t kCandidates[] = {16384, 8192, 4096, 2048, 1024, 512, 256, 128, 64, 8};
  // Preference: a vocab chunk of at least kMinGoodVocabChunk (or all of V) so every logits GEMM stays
  // large, then the fewest token chunks (each costs one more f32 read-modify-write of d_weight), then the
  // full cuBLASLt workspace. Measured at V = 250k, N = 8192 (bench/notes/fused_linear_cross_entropy.md):
  // Vc = 4096 and Vc = 15632 run alike, Vc = 1024 loses 9%, one token chunk more costs about 5%.
  FusedCrossEntropyChunks best;
  int64_t best_chunks = 0;
  bool best_small = true;
  const size_t lt_options[2] = {p.gemm_workspace_bytes ? p.gemm_workspace_bytes : kLtWorkspaceBytes,
                                p.gemm_workspace_bytes ? p.gemm_workspace_bytes : kLtWorkspaceTightBytes};
  for (int64_t requested : kCandidates) {
    if (p.vocab_chunk > 0) requested = p.vocab_chunk;
    const int64_t vc = vocab_chunk_for(p, requested, p.vocab_chunk == 0);
    const bool small = requested < kMinGoodVocabChunk && vc < round_up(p.vocab, 8);  // before balancing
    for (size_t lt_bytes : lt_options) {
      const int64_t nc_max = largest_fitting_token_chunk(p, vc, lt_bytes, max_workspace_bytes);
      if (nc_max == 0) continue;
      // As few token chunks as fit, then equal ones, rounded up to a GEMM-friendly multiple when that fits.
      const int64_t n_chunks = ceil_div(p.tokens, nc_max);
      const int64_t balanced = ceil_div(p.tokens, n_chunks);
      const int64_t rounded = std::min(round_up(balanced, kTokenChunkAlign), p.tokens);
      const int64_t nc = rounded <= nc_max ? rounded : balanced;
      if (best_chunks == 0 || (best_small && !small) || (small == best_small && n_chunks < best_chunks)) {
        best = {nc, vc, lt_bytes};
        best_chunks = n_chunks;
        best_small = small;
      }
    }
    if (p.vocab_chunk > 0) break;
  }
  KESTREL_CHECK(best_chunks > 0, kOp, "no chunking fits a workspace of ", max_workspace_bytes, " bytes (N=",
                p.tokens, " V=", p.vocab, "; the smallest needs ", make_layout(p, 1, 8, lt_options[1]).total, ")");
  return best;
}

FusedCrossEntropyChunks resolve_fused_linear_cross_entropy_chunks(const FusedLinearCrossEntropyParams& p) {
  check_shape(p);
  const size_t lt_bytes = p.gemm_workspace_bytes ? p.gemm_workspace_bytes : kLtWorkspaceBytes;
  if (p.token_chunk > 0 && p.vocab_chunk > 0)
    return {std::min(p.token_chunk, p.tokens), vocab_chunk_for(p, p.vocab_chunk, false), lt_bytes};
  if (p.token_chunk > 0)
    return {std::min(p.token_chunk, p.tokens), vocab_chunk_for(p, kDefaultVocabChunk, true), lt_bytes};
  return pick_fused_linear_cross_entropy_chunks(p, kDefaultWorkspaceBound);
}

size_t fused_linear_cross_entropy_workspace_bytes(const FusedLinearCrossEntropyParams& p) {
  return resolved_layout(p).total;
}

void fused_linear_cross_entropy(const FusedLinearCrossEntropyParams& p, void* workspace, size_t workspace_bytes,
                                cublasLtHandle_t lt, cudaStream_t stream) {
  check_shape(p);
  KESTREL_CHECK(p.hidden_states && p.weight && p.labels && p.loss, kOp,
                "hidden_states, weight, labels and loss must be non-null");
  KESTREL_CHECK(p.label_smoothing >= 0.0f && p.label_smoothing <= 1.0f, kOp, "label_smoothing must be in [0, 1], got ",
                p.label_smoothing);
  KESTREL_CHECK(lt != nullptr, kOp, "cublasLt handle is null");
  const Layout l = resolved_layout(p);
  KESTREL_CHECK(workspace != nullptr && reinterpret_cast<uintptr_t>(workspace) % 256 == 0, kOp,
                "workspace must be non-null and 256-byte aligned");
  KESTREL_CHECK(workspace_bytes >= l.total, kOp, "workspace of ", workspace_bytes, " bytes is too small, need ",
                l.total);

  char* ws = static_cast<char*>(workspace);
  void* lt_ws = ws + l.lt;
  float* logits = reinterpret_cast<float*>(ws + l.logits);
  void* store = p.wants_gradients() ? ws + l.store : nullptr;
  float* pmax = reinterpret_cast<float*>(ws + l.pmax);
  float* psum = reinterpret_cast<float*>(ws + l.psum);
  float* plsum = reinterpret_cast<float*>(ws + l.plsum);
  float* label_logit = reinterpret_cast<float*>(ws + l.label_logit);
  float* row_coef = reinterpret_cast<float*>(ws + l.row_coef);
  float* token_loss = reinterpret_cast<float*>(ws + l.token_loss);
  float* weight_sum = reinterpret_cast<float*>(ws + l.weight_sum);

  const size_t elem = dtype_size(p.dtype);
  const cudaDataType_t ab_type = cuda_type(p.dtype);
  const auto* x = static_cast<const char*>(p.hidden_states);  // [N, H]
  const auto* w = static_cast<const char*>(p.weight);         // [V, H]
  const int64_t n = p.tokens, h = p.hidden, v = p.vocab;
  const bool mean = p.reduction == CrossEntropyReduction::Mean;

  fused_ce::launch_prepare(p.labels, p.token_weights, n, v, p.ignore_index, weight_sum, p.error_flag, stream);

  for (int64_t t0 = 0; t0 < n; t0 += l.nc) {
    const int64_t nc = std::min(l.nc, n - t0);
    const char* x_c = x + size_t(t0) * size_t(h) * elem;  // [nc, H]
    for (int64_t ci = 0; ci < l.n_vchunks; ++ci) {
      const int64_t v0 = ci * l.vc, vc = std::min(l.vc, v - v0);
      // logits^T [vc, nc] (column-major) = W_v [vc, H] . X_c^T
      fused_ce::GemmDesc g{CUBLAS_OP_T, CUBLAS_OP_N, vc, nc, h, h, h, l.vc, ab_type, CUDA_R_32F};
      fused_ce::lt_matmul(lt, g, w + size_t(v0) * size_t(h) * elem, x_c, logits, 0.0f, lt_ws, l.lt_bytes,
                          stream);
      fused_ce::ChunkStatsArgs s;
      s.logits = logits;
      s.ld_logits = l.vc;
      s.nc = nc;
      s.vc = vc;
      s.v0 = v0;
      s.chunk = int(ci);
      s.n_vchunks = int(l.n_vchunks);
      s.labels = p.labels + t0;
      s.vocab = v;
      s.ignore_index = p.ignore_index;
      s.store = store;
      s.ld_store = l.ld_store;
      s.pmax = pmax;
      s.psum = psum;
      s.plsum = plsum;
      s.label_logit = label_logit;
      fused_ce::launch_chunk_stats(s, p.dtype, stream);
    }

    fused_ce::RowFinalizeArgs r;
    r.nc = nc;
    r.t0 = t0;
    r.n_vchunks = int(l.n_vchunks);
    r.labels = p.labels;
    r.token_weights = p.token_weights;
    r.vocab = v;
    r.ignore_index = p.ignore_index;
    r.mean = mean;
    r.z_loss = p.z_loss;
    r.label_smoothing = p.label_smoothing;
    r.weight_sum = weight_sum;
    r.upstream_grad = p.upstream_grad;
    r.pmax = pmax;
    r.psum = psum;
    r.plsum = plsum;
    r.label_logit = label_logit;
    r.lse_out = p.lse;
    r.token_loss = token_loss;
    r.row_coef = row_coef;
    fused_ce::launch_row_finalize(r, stream);

    if (!p.wants_gradients()) continue;
    fused_ce::FormGradArgs f;
    f.store = store;
    f.ld_store = l.ld_store;
    f.nc = nc;
    f.vocab = v;
    f.vocab_chunk = l.vc;
    f.n_vchunks = int(l.n_vchunks);
    f.labels = p.labels + t0;
    f.pmax = pmax;
    f.row_coef = row_coef;
    fused_ce::launch_form_grad(f, p.dtype, stream);

    if (p.d_hidden) {
      // d_hidden_c^T [H, nc] = W^T [H, V] . G^T [V, nc]
      fused_ce::GemmDesc g{CUBLAS_OP_N, CUBLAS_OP_N, h, nc, v, h, l.ld_store, h, ab_type, ab_type};
      fused_ce::lt_matmul(lt, g, w, store, static_cast<char*>(p.d_hidden) + size_t(t0) * size_t(h) * elem, 0.0f,
                          lt_ws, l.lt_bytes, stream);
    }
    if (p.d_weight) {
      // d_weight^T [H, V] (+)= X_c^T [H, nc] . G [nc, V]
      KESTREL_CHECK(p.d_weight_f32 || nc == n, kOp, "a d_weight in the input dtype needs one token chunk (",
                    l.nc, " < ", n, " tokens)");
      fused_ce::GemmDesc g{CUBLAS_OP_N, CUBLAS_OP_T, h, v, nc, h, l.ld_store, h, ab_type,
                           p.d_weight_f32 ? CUDA_R_32F : ab_type};
      const float beta = (p.accumulate_d_weight || t0 > 0) ? 1.0f : 0.0f;
      fused_ce::lt_matmul(lt, g, x_c, store, p.d_weight, beta, lt_ws, l.lt_bytes, stream);
    }
  }

  fused_ce::launch_final_loss(token_loss, n, weight_sum, mean, p.loss, stream);
}

}  // namespace kestrel::cuda
