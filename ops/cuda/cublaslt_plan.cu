// The cuBLASLt plan cache (cuda/cublaslt_plan.h states the policy).
#include "cuda/cublaslt_plan.h"

#include <unordered_map>

#include "kestrel/cuda/check.h"
#include "kestrel/runtime/error.h"

namespace kestrel::cuda_ops {
namespace {

struct PlanCache {
  std::mutex mutex;
  std::unordered_map<std::string, std::unique_ptr<LtPlan>> plans;
};

PlanCache& cache() {
  static auto* c = new PlanCache();  // leaked on purpose: plans outlive static teardown
  return *c;
}

struct PreferenceGuard {
  cublasLtMatmulPreference_t pref = nullptr;
  ~PreferenceGuard() {
    const cuda::CublasLtApi& api = cuda::cublaslt_api();
    if (pref) api.MatmulPreferenceDestroy(pref);
  }
};

}  // namespace

LtPlan::~LtPlan() {
  const cuda::CublasLtApi& api = cuda::cublaslt_api();
  // Host-only objects: a failed destroy leaks a few bytes, so the statuses are not checked.
  if (c) api.MatrixLayoutDestroy(c);
  if (b) api.MatrixLayoutDestroy(b);
  if (a) api.MatrixLayoutDestroy(a);
  if (desc) api.MatmulDescDestroy(desc);
}

int lt_alignment(const void* p, int64_t batch_stride_bytes, int64_t batch) {
  uintptr_t v = reinterpret_cast<uintptr_t>(p);
  if (batch > 1) v |= static_cast<uintptr_t>(batch_stride_bytes);
  int a = 256;
  while (a > 1 && (v & (a - 1)) != 0) a >>= 1;
  return a;
}

std::string lt_plan_key(const char* op, std::initializer_list<int64_t> parts) {
  std::string key(op);
  key.push_back('\0');
  key.append(reinterpret_cast<const char*>(parts.begin()), parts.size() * sizeof(int64_t));
  return key;
}

LtPlan* lt_find_plan(const std::string& key) {
  PlanCache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  auto it = c.plans.find(key);
  return it == c.plans.end() ? nullptr : it->second.get();
}

void lt_choose_algorithm(cublasLtHandle_t lt, LtPlan& plan, int align_a, int align_b, int align_c,
                         size_t workspace_bytes, const char* op, const std::string& what) {
  PreferenceGuard pref;
  const cuda::CublasLtApi& api = cuda::cublaslt_api();
  KESTREL_CUBLAS_CHECK(api.MatmulPreferenceCreate(&pref.pref));
  const uint64_t ws = workspace_bytes;
  const uint32_t ua = align_a, ub = align_b, uc = align_c;
  KESTREL_CUBLAS_CHECK(
      api.MatmulPreferenceSetAttribute(pref.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  KESTREL_CUBLAS_CHECK(
      api.MatmulPreferenceSetAttribute(pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &ua, sizeof(ua)));
  KESTREL_CUBLAS_CHECK(
      api.MatmulPreferenceSetAttribute(pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ub, sizeof(ub)));
  KESTREL_CUBLAS_CHECK(
      api.MatmulPreferenceSetAttribute(pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &uc, sizeof(uc)));
  KESTREL_CUBLAS_CHECK(
      api.MatmulPreferenceSetAttribute(pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &uc, sizeof(uc)));
  cublasLtMatmulHeuristicResult_t result{};
  int count = 0;
  KESTREL_CUBLAS_CHECK(
      api.MatmulAlgoGetHeuristic(lt, plan.desc, plan.a, plan.b, plan.c, plan.c, pref.pref, 1, &result, &count));
  KESTREL_CHECK(count > 0, op, "cuBLASLt found no algorithm for ", what);
  plan.algo = result.algo;
}

LtPlan& lt_insert_plan(const std::string& key, std::unique_ptr<LtPlan> plan) {
  PlanCache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  return *c.plans.emplace(key, std::move(plan)).first->second;
}

void lt_launch(cublasLtHandle_t lt, LtPlan& plan, std::initializer_list<LtPointerAttribute> pointers,
               const float* alpha, const void* a, const void* b, const float* beta, void* d, void* workspace,
               size_t workspace_bytes, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(plan.launch_mutex);
  const cuda::CublasLtApi& api = cuda::cublaslt_api();
  for (const LtPointerAttribute& p : pointers)
    KESTREL_CUBLAS_CHECK(api.MatmulDescSetAttribute(plan.desc, p.attribute, &p.value, sizeof(p.value)));
  KESTREL_CUBLAS_CHECK(api.Matmul(lt, plan.desc, alpha, a, plan.a, b, plan.b, beta, d, plan.c, d, plan.c, &plan.algo,
                                  workspace, workspace_bytes, stream));
}

}  // namespace kestrel::cuda_ops
