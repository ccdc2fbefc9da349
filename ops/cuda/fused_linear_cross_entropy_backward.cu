// Backward of the fused linear + cross-entropy from the forward's log-sum-exp (the declaration and
// the memory it needs are in fused_linear_cross_entropy.h).
//
// Per vocabulary chunk [v0, v0 + vc), per token chunk [t0, t0 + nc):
//   logits = X_c W_v^T (f32)  ->  G = a exp(logits - lse) - e - [j == y] b  (input dtype)
//   d_hidden_c (+)= G W_v      (f32 accumulator over the vocabulary chunks, cast once at the end)
//   d_weight_v (+)= G^T X_c    (straight into d_weight when the tokens are one chunk: f32 accumulation
//                               inside the GEMM, one rounding, and beta = 1 adds into a held gradient)
// Because the lse is known, no second softmax pass and no [nc, V] kept row are needed: the workspace is
// one [nc, vc] f32 logits block and its gradient, so nc covers 8k-16k tokens at any vocabulary, and
// no [V, H] f32 buffer exists unless the tokens span several chunks (then one [vc, H] f32 block).
#include <algorithm>

#include "cuda/fused_linear_cross_entropy.h"
#include "cuda/fused_linear_cross_entropy_internal.h"
#include "kestrel/runtime/error.h"

namespace kestrel::cuda {
namespace {

constexpr const char* kOp = "fused_linear_cross_entropy_backward";

// Chunks and offsets: kestrel/ops/workspace_sizes.h (the memory planner sizes the same layout).
workspace::FusedCrossEntropyBackwardLayout backward_layout(const FusedLinearCrossEntropyParams& p) {
  return workspace::fused_cross_entropy_backward_layout(fused_ce::workspace_shape(p));
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::BF16: return CUDA_R_16BF;
    case DType::F16: return CUDA_R_16F;
    case DType::F32: return CUDA_R_32F;
    default: throw make_error(kOp, "dtype must be bf16, f16 or f32, got ", dtype_name(t));
  }
}

}  // namespace

size_t fused_linear_cross_entropy_backward_workspace_bytes(const FusedLinearCrossEntropyParams& p) {
  return backward_layout(p).total;
}

void fused_linear_cross_entropy_backward(const FusedLinearCrossEntropyParams& p, const float* lse, void* workspace,
                                         size_t workspace_bytes, cublasLtHandle_t lt, cudaStream_t stream) {
  KESTREL_CHECK(p.tokens >= 0 && p.hidden > 0 && p.vocab > 0, kOp, "bad shape N=", p.tokens, " H=", p.hidden,
                " V=", p.vocab);
  KESTREL_CHECK(p.hidden_states && p.weight && p.labels && lse, kOp, "hidden_states, weight, labels and lse must be non-null");
  KESTREL_CHECK(p.label_smoothing >= 0.0f && p.label_smoothing <= 1.0f, kOp, "label_smoothing must be in [0, 1]");
  const workspace::FusedCrossEntropyBackwardLayout l = backward_layout(p);
  KESTREL_CHECK(workspace != nullptr && reinterpret_cast<uintptr_t>(workspace) % 256 == 0 && workspace_bytes >= l.total,
                kOp, "workspace must be 256-byte aligned and hold ", l.total, " bytes, got ", workspace_bytes);
  if (p.tokens == 0 || (!p.d_hidden && !p.d_weight)) return;

  char* ws = static_cast<char*>(workspace);
  void* lt_ws = ws + l.lt;
  const size_t lt_bytes = l.lt_bytes;
  float* logits = reinterpret_cast<float*>(ws + l.logits);
  void* grad = ws + l.grad;
  float* coef = reinterpret_cast<float*>(ws + l.coef);
  float* weight_sum = reinterpret_cast<float*>(ws + l.weight_sum);
  float* dh = l.dh_f32_scratch ? reinterpret_cast<float*>(ws + l.dh32) : static_cast<float*>(p.d_hidden);
  float* dw32 = l.dw_f32_scratch ? reinterpret_cast<float*>(ws + l.dw32) : nullptr;

  const size_t elem = dtype_size(p.dtype);
  const cudaDataType_t ab = cuda_type(p.dtype);
  const auto* x = static_cast<const char*>(p.hidden_states);  // [N, H]
  const auto* w = static_cast<const char*>(p.weight);         // [V, H]
  const int64_t n = p.tokens, h = p.hidden, v = p.vocab;
  const size_t dw_elem = p.d_weight_f32 ? 4 : elem;

  fused_ce::launch_prepare(p.labels, p.token_weights, n, v, p.ignore_index, weight_sum, p.error_flag, stream);
  fused_ce::LseCoefArgs ca;
  ca.labels = p.labels;
  ca.token_weights = p.token_weights;
  ca.lse = lse;
  ca.weight_sum = weight_sum;
  ca.upstream_grad = p.upstream_grad;
  ca.n = n;
  ca.vocab = v;
  ca.ignore_index = p.ignore_index;
  ca.mean = p.reduction == CrossEntropyReduction::Mean;
  ca.z_loss = p.z_loss;
  ca.label_smoothing = p.label_smoothing;
  ca.row_coef = coef;
  fused_ce::launch_row_coef_from_lse(ca, stream);

  for (int64_t v0 = 0; v0 < v; v0 += l.vc) {
    const int64_t vc = std::min(l.vc, v - v0);
    const char* w_v = w + size_t(v0) * size_t(h) * elem;  // [vc, H]
    for (int64_t t0 = 0; t0 < n; t0 += l.nc) {
      const int64_t nc = std::min(l.nc, n - t0);
      const char* x_c = x + size_t(t0) * size_t(h) * elem;  // [nc, H]
      // logits^T [vc, nc] (column-major; row-major [nc, l.vc]) = W_v [vc, H] . X_c^T
      fused_ce::GemmDesc gl{CUBLAS_OP_T, CUBLAS_OP_N, vc, nc, h, h, h, l.vc, ab, CUDA_R_32F};
      fused_ce::lt_matmul(lt, gl, w_v, x_c, logits, 0.0f, lt_ws, lt_bytes, stream);
      fused_ce::LseGradArgs ga;
      ga.logits = logits;
      ga.grad = grad;
      ga.ld = l.vc;
      ga.nc = nc;
      ga.vc = vc;
      ga.v0 = v0;
      ga.t0 = t0;
      ga.n = n;
      ga.labels = p.labels;
      ga.row_coef = coef;
      fused_ce::launch_grad_from_lse(ga, p.dtype, stream);
      if (p.d_hidden) {
        // d_hidden_c^T [H, nc] (+)= W_v^T [H, vc] . G^T [vc, nc]   (f32)
        fused_ce::GemmDesc gh{CUBLAS_OP_N, CUBLAS_OP_N, h, nc, vc, h, l.vc, h, ab, CUDA_R_32F};
        fused_ce::lt_matmul(lt, gh, w_v, grad, dh + size_t(t0) * size_t(h), v0 > 0 ? 1.0f : 0.0f, lt_ws, lt_bytes,
                            stream);
      }
      if (p.d_weight) {
        // d_weight_v^T [H, vc] (+)= X_c^T [H, nc] . G [nc, vc]
        const bool scratch = dw32 != nullptr;
        fused_ce::GemmDesc gw{CUBLAS_OP_N, CUBLAS_OP_T, h, vc, nc, h, l.vc, h, ab,
                              scratch || p.d_weight_f32 ? CUDA_R_32F : ab};
        void* dst = scratch ? static_cast<void*>(dw32)
                            : static_cast<void*>(static_cast<char*>(p.d_weight) + size_t(v0) * size_t(h) * dw_elem);
        const float beta = scratch ? (t0 > 0 ? 1.0f : 0.0f) : ((p.accumulate_d_weight || t0 > 0) ? 1.0f : 0.0f);
        fused_ce::lt_matmul(lt, gw, x_c, grad, dst, beta, lt_ws, lt_bytes, stream);
      }
    }
    if (dw32)
      fused_ce::launch_store_f32(static_cast<char*>(p.d_weight) + size_t(v0) * size_t(h) * elem, p.dtype, dw32,
                                 vc * h, p.accumulate_d_weight, stream);
  }
  if (l.dh_f32_scratch) fused_ce::launch_store_f32(p.d_hidden, p.dtype, dh, n * h, false, stream);
}

}  // namespace kestrel::cuda
