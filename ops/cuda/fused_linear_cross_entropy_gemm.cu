// cuBLASLt GEMM for the fused linear + cross-entropy, through the shared plan cache
// (cuda/cublaslt_plan.h).
//
// A plan (matmul descriptor, the A, B and D layouts, the heuristic's first algorithm) is built once per
// (handle, shape, leading dimensions, types, pointer alignments, beta != 0, workspace size) and reused:
// cublasLtMatmulAlgoGetHeuristic costs tens of microseconds, the matmul launch a few. Pointer
// alignments are part of the key because the heuristic assumes 256-byte aligned buffers unless told
// otherwise, and chunk pointers (X + t0 * H) need not be. Plans live until the process exits.
#include <cstdint>
#include <memory>
#include <string>

#include "cuda/cublaslt_plan.h"
#include "cuda/fused_linear_cross_entropy_internal.h"
#include "kestrel/cuda/check.h"
#include "kestrel/runtime/error.h"

namespace kestrel::cuda::fused_ce {

void lt_matmul(cublasLtHandle_t lt, const GemmDesc& g, const void* a, const void* b, void* d, float beta,
               void* lt_workspace, size_t lt_workspace_bytes, cudaStream_t stream) {
  using namespace cuda_ops;
  if (g.m == 0 || g.n == 0) return;
  const int al_a = lt_alignment(a), al_b = lt_alignment(b), al_d = lt_alignment(d);
  const std::string key = lt_plan_key(
      "fused_linear_cross_entropy",
      {static_cast<int64_t>(reinterpret_cast<intptr_t>(lt)), g.trans_a, g.trans_b, g.m, g.n, g.k, g.lda, g.ldb, g.ldd,
       g.ab_type, g.d_type, al_a, al_b, al_d, beta != 0.0f, static_cast<int64_t>(lt_workspace_bytes)});
  LtPlan* plan = lt_find_plan(key);
  if (!plan) {
    auto fresh = std::make_unique<LtPlan>();
    const cuda::CublasLtApi& api = cuda::cublaslt_api();
    // f32 inputs stay true f32 (no TF32): the f32 path is the accuracy reference of the op.
    KESTREL_CUBLAS_CHECK(api.MatmulDescCreate(&fresh->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    KESTREL_CUBLAS_CHECK(
        api.MatmulDescSetAttribute(fresh->desc, CUBLASLT_MATMUL_DESC_TRANSA, &g.trans_a, sizeof(g.trans_a)));
    KESTREL_CUBLAS_CHECK(
        api.MatmulDescSetAttribute(fresh->desc, CUBLASLT_MATMUL_DESC_TRANSB, &g.trans_b, sizeof(g.trans_b)));
    // Stored (pre-op) shapes, column-major.
    const bool ta = g.trans_a != CUBLAS_OP_N, tb = g.trans_b != CUBLAS_OP_N;
    KESTREL_CUBLAS_CHECK(api.MatrixLayoutCreate(&fresh->a, g.ab_type, ta ? g.k : g.m, ta ? g.m : g.k, g.lda));
    KESTREL_CUBLAS_CHECK(api.MatrixLayoutCreate(&fresh->b, g.ab_type, tb ? g.n : g.k, tb ? g.k : g.n, g.ldb));
    KESTREL_CUBLAS_CHECK(api.MatrixLayoutCreate(&fresh->c, g.d_type, g.m, g.n, g.ldd));
    lt_choose_algorithm(lt, *fresh, al_a, al_b, al_d, lt_workspace_bytes, "fused_linear_cross_entropy",
                        detail::concat("m=", g.m, " n=", g.n, " k=", g.k, " lda=", g.lda, " ldb=", g.ldb,
                                       " ldd=", g.ldd));
    plan = &lt_insert_plan(key, std::move(fresh));
  }
  const float alpha = 1.0f;
  lt_launch(lt, *plan, {}, &alpha, a, b, &beta, d, lt_workspace, lt_workspace_bytes, stream);
}

}  // namespace kestrel::cuda::fused_ce
