// Host side of the fused linear + cross-entropy: argument checks and the launch sequence (see
// fused_linear_cross_entropy.h for the algorithm and its memory). The chunk picker and the workspace
// layout are kestrel/ops/workspace_sizes.h, which the memory planner calls too.
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
#include "kestrel/cuda/check.h"
#include "kestrel/runtime/error.h"

namespace kestrel::cuda {
namespace {

constexpr const char* kOp = "fused_linear_cross_entropy";

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::BF16: return CUDA_R_16BF;
    case DType::F16: return CUDA_R_16F;
    case DType::F32: return CUDA_R_32F;
    default: throw make_error(kOp, "dtype must be bf16, f16 or f32, got ", dtype_name(t));
  }
}

FusedCrossEntropyChunks to_chunks(const workspace::FusedCrossEntropyChunks& c) {
  return {c.token_chunk, c.vocab_chunk, c.gemm_workspace_bytes};
}

}  // namespace

FusedCrossEntropyChunks pick_fused_linear_cross_entropy_chunks(const FusedLinearCrossEntropyParams& p,
                                                               size_t max_workspace_bytes) {
  return to_chunks(workspace::pick_fused_cross_entropy_chunks(fused_ce::workspace_shape(p), max_workspace_bytes));
}

FusedCrossEntropyChunks resolve_fused_linear_cross_entropy_chunks(const FusedLinearCrossEntropyParams& p) {
  return to_chunks(workspace::resolve_fused_cross_entropy_chunks(fused_ce::workspace_shape(p)));
}

size_t fused_linear_cross_entropy_workspace_bytes(const FusedLinearCrossEntropyParams& p) {
  return workspace::resolved_fused_cross_entropy_layout(fused_ce::workspace_shape(p)).total;
}

void fused_linear_cross_entropy(const FusedLinearCrossEntropyParams& p, void* workspace, size_t workspace_bytes,
                                cublasLtHandle_t lt, cudaStream_t stream) {
  // The chunks and the buffers' offsets (kestrel/ops/workspace_sizes.h; checks the shape).
  const workspace::FusedCrossEntropyLayout l =
      workspace::resolved_fused_cross_entropy_layout(fused_ce::workspace_shape(p));
  KESTREL_CHECK(p.hidden_states && p.weight && p.labels && p.loss, kOp,
                "hidden_states, weight, labels and loss must be non-null");
  KESTREL_CHECK(p.label_smoothing >= 0.0f && p.label_smoothing <= 1.0f, kOp, "label_smoothing must be in [0, 1], got ",
                p.label_smoothing);
  KESTREL_CHECK(lt != nullptr, kOp, "cublasLt handle is null");
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
      // d_weight^T [H, V] (+)= X_c^T [H, nc] . G [nc, V]  (a 16-bit d_weight is rounded once per token chunk)
      fused_ce::GemmDesc g{CUBLAS_OP_N, CUBLAS_OP_T, h, v, nc, h, l.ld_store, h, ab_type,
                           p.d_weight_f32 ? CUDA_R_32F : ab_type};
      const float beta = (p.accumulate_d_weight || t0 > 0) ? 1.0f : 0.0f;
      fused_ce::lt_matmul(lt, g, x_c, store, p.d_weight, beta, lt_ws, l.lt_bytes, stream);
    }
  }

  fused_ce::launch_final_loss(token_loss, n, weight_sum, mean, p.loss, stream);
}

}  // namespace kestrel::cuda
