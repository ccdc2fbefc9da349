// cuBLASLt GEMM with a process-wide plan cache for the fused linear + cross-entropy.
//
// A plan (matmul descriptor, four layouts, the heuristic's first algorithm) is built once per
// (handle, shape, leading dimensions, types, pointer alignments, beta != 0, workspace size) and reused:
// cublasLtMatmulAlgoGetHeuristic costs tens of microseconds, the matmul launch a few. Pointer
// alignments are part of the key because the heuristic assumes 256-byte aligned buffers unless told
// otherwise, and chunk pointers (X + t0 * H) need not be. Plans live until the process exits.
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "cuda/fused_linear_cross_entropy_internal.h"
#include "kestrel/cuda/check.h"
#include "kestrel/runtime/error.h"

namespace kestrel::cuda::fused_ce {
namespace {

uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && (a % align) != 0) align /= 2;
  return align;
}

struct PlanKey {
  uintptr_t handle;
  int ta, tb;
  int64_t m, n, k, lda, ldb, ldd;
  int ab_type, d_type;
  uint32_t align_a, align_b, align_d;
  bool beta_nonzero;
  size_t workspace;
  auto operator<=>(const PlanKey&) const = default;
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    // Host-only objects; a failed destroy only leaks a few bytes, so the statuses are not checked.
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

struct PreferenceGuard {
  cublasLtMatmulPreference_t pref = nullptr;
  ~PreferenceGuard() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
  }
};

cublasComputeType_t compute_type_for(cudaDataType_t ab) {
  // f32 inputs stay true f32 (no TF32): the f32 path is the accuracy reference of the op.
  (void)ab;
  return CUBLAS_COMPUTE_32F;
}

std::unique_ptr<Plan> build_plan(cublasLtHandle_t lt, const PlanKey& key, const GemmDesc& g) {
  auto plan = std::make_unique<Plan>();
  KESTREL_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->desc, compute_type_for(g.ab_type), CUDA_R_32F));
  KESTREL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &g.trans_a,
                                                      sizeof(g.trans_a)));
  KESTREL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &g.trans_b,
                                                      sizeof(g.trans_b)));
  // Stored (pre-op) shapes, column-major.
  const bool ta = g.trans_a != CUBLAS_OP_N, tb = g.trans_b != CUBLAS_OP_N;
  KESTREL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, g.ab_type, ta ? g.k : g.m, ta ? g.m : g.k, g.lda));
  KESTREL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, g.ab_type, tb ? g.n : g.k, tb ? g.k : g.n, g.ldb));
  KESTREL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->d, g.d_type, g.m, g.n, g.ldd));

  PreferenceGuard pref;
  KESTREL_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref.pref));
  const uint64_t ws = key.workspace;
  KESTREL_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                            &ws, sizeof(ws)));
  KESTREL_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                            &key.align_a, sizeof(key.align_a)));
  KESTREL_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                            &key.align_b, sizeof(key.align_b)));
  KESTREL_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                            &key.align_d, sizeof(key.align_d)));
  KESTREL_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                            &key.align_d, sizeof(key.align_d)));
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  KESTREL_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, plan->desc, plan->a, plan->b, plan->d, plan->d,
                                                      pref.pref, 1, &result, &returned));
  KESTREL_CHECK(returned > 0, "fused_linear_cross_entropy", "cuBLASLt has no algorithm for m=", g.m, " n=", g.n,
                " k=", g.k, " lda=", g.lda, " ldb=", g.ldb, " ldd=", g.ldd);
  plan->algo = result.algo;
  return plan;
}

std::mutex g_plans_mutex;
std::map<PlanKey, std::unique_ptr<Plan>>& plans() {
  static auto* cache = new std::map<PlanKey, std::unique_ptr<Plan>>();  // leaked: outlives static teardown
  return *cache;
}

}  // namespace

void lt_matmul(cublasLtHandle_t lt, const GemmDesc& g, const void* a, const void* b, void* d, float beta,
               void* lt_workspace, size_t lt_workspace_bytes, cudaStream_t stream) {
  if (g.m == 0 || g.n == 0) return;
  const PlanKey key{reinterpret_cast<uintptr_t>(lt), int(g.trans_a), int(g.trans_b), g.m, g.n, g.k, g.lda,
                    g.ldb, g.ldd, int(g.ab_type), int(g.d_type), alignment_of(a), alignment_of(b),
                    alignment_of(d), beta != 0.0f, lt_workspace_bytes};
  const Plan* plan = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_plans_mutex);
    auto& cache = plans();
    auto it = cache.find(key);
    if (it == cache.end()) it = cache.emplace(key, build_plan(lt, key, g)).first;
    plan = it->second.get();
  }
  const float alpha = 1.0f;
  KESTREL_CUBLAS_CHECK(cublasLtMatmul(lt, plan->desc, &alpha, a, plan->a, b, plan->b, &beta, d, plan->d, d,
                                      plan->d, &plan->algo, lt_workspace, lt_workspace_bytes, stream));
}

}  // namespace kestrel::cuda::fused_ce
