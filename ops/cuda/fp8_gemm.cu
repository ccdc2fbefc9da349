// CUDA FP8 GEMM through cuBLASLt (the fp8_gemm slot of kernels/fp8.h).
//
// out [M, N] row-major = (a [M, K] . b [N, K]^T) * a_scale_inv * b_scale_inv, with a and b fp8
// row-major (K-contiguous). cuBLASLt is column-major: out^T (N x M, ld N) = op(A) op(B) with A = b
// (stored K x N, ld K, TRANSA = T) and B = a (stored K x M, ld K, TRANSB = N) — the "TN" layout that
// cuBLASLt's FP8 kernels require on sm_90. The dequantisation factors go in as device pointers
// (A_SCALE_POINTER / B_SCALE_POINTER), so nothing is read on the host. cuBLASLt refuses a scale pointer
// that is not 16-byte aligned (CUBLAS_STATUS_NOT_SUPPORTED from cublasLtMatmul after a successful heuristic;
// found on the H200 with a standalone A/B of the settings, 2026-12-01), and a tensor's 1/scale sits at
// scales[1], 4 bytes in: one thread copies both factors into a 16-byte-aligned workspace first (stream
// ordered, no host sync). D (and C, unused: beta = 0)
// is bf16, compute f32. FAST_ACCUM skips the periodic promotion of the tensor cores' partial sums
// to f32: faster, less accurate; linear_fp8 asks for it on the forward only.
// The heuristic's algorithm is cached per (shapes, formats, fast_accum, alignment, device).
#include <mutex>
#include <string>
#include <unordered_map>

#include "cuda/common.cuh"
#include "kernels/fp8.h"
#include "kestrel/runtime/memory.h"

namespace kestrel::cuda_ops {
namespace {

struct LtFp8Handles {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtFp8Handles() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

cudaDataType_t fp8_type(Fp8Format f) { return f == Fp8Format::E4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

int alignment_of(const void* p) {
  uintptr_t v = reinterpret_cast<uintptr_t>(p);
  int a = 256;
  while (a > 1 && (v & (a - 1)) != 0) a >>= 1;
  return a;
}

// scratch[0] = the cuBLASLt A operand's (our b's) 1/scale, scratch[4] = its B operand's (our a's).
__global__ void gather_dequant_scales(const float* b_scales, const float* a_scales, float* scratch) {
  scratch[0] = b_scales[1];
  scratch[4] = a_scales[1];
}

std::mutex g_fp8_cache_mutex;
std::unordered_map<std::string, cublasLtMatmulAlgo_t> g_fp8_algo_cache;

void fp8_gemm_cuda(const Tensor& out, const Tensor& a, Fp8Format fa, const Tensor& a_scales, const Tensor& b,
                   Fp8Format fb, const Tensor& b_scales, bool fast_accum) {
  KESTREL_CHECK(out.dtype() == DType::BF16, "fp8_gemm", "the CUDA FP8 GEMM writes bf16, got ", dtype_name(out.dtype()));
  const int64_t M = a.shape()[0], K = a.shape()[1], N = b.shape()[0];
  LtFp8Handles h;
  KESTREL_CUBLAS_CHECK(cublasLtMatmulDescCreate(&h.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  KESTREL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(h.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  KESTREL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(h.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  // cuBLASLt's A is our b, its B our a: the scale pointers follow (16-byte aligned copies, see the top).
  Tensor scratch;
  {
    TagScope tag(MemoryTag::Workspace);
    scratch = Tensor::empty({8}, DType::F32, out.device());
  }
  gather_dequant_scales<<<1, 1, 0, cuda::current_stream()>>>(static_cast<const float*>(b_scales.data_ptr()),
                                                              static_cast<const float*>(a_scales.data_ptr()),
                                                              static_cast<float*>(scratch.data_ptr()));
  KESTREL_CUDA_CHECK_LAUNCH();
  const void* sa = static_cast<const float*>(scratch.data_ptr());
  const void* sb = static_cast<const float*>(scratch.data_ptr()) + 4;
  KESTREL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(h.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
  KESTREL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(h.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
  const int8_t fast = fast_accum ? 1 : 0;
  KESTREL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(h.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
  KESTREL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&h.la, fp8_type(fb), static_cast<uint64_t>(K),
                                                  static_cast<uint64_t>(N), K));
  KESTREL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&h.lb, fp8_type(fa), static_cast<uint64_t>(K),
                                                  static_cast<uint64_t>(M), K));
  KESTREL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&h.lc, CUDA_R_16BF, static_cast<uint64_t>(N),
                                                  static_cast<uint64_t>(M), N));

  size_t ws_bytes = 0;
  void* ws = cuda::cublaslt_workspace(&ws_bytes);
  cublasLtHandle_t lt = cuda::cublaslt_handle();
  const int al_a = alignment_of(b.data_ptr()), al_b = alignment_of(a.data_ptr()), al_c = alignment_of(out.data_ptr());
  std::string key;
  {
    const int64_t parts[] = {M, N, K, static_cast<int64_t>(fa), static_cast<int64_t>(fb), fast, al_a, al_b, al_c,
                             cuda::current_device(), static_cast<int64_t>(ws_bytes)};
    key.assign(reinterpret_cast<const char*>(parts), sizeof(parts));
  }
  cublasLtMatmulAlgo_t algo;
  bool found = false;
  {
    std::lock_guard<std::mutex> lock(g_fp8_cache_mutex);
    auto it = g_fp8_algo_cache.find(key);
    if (it != g_fp8_algo_cache.end()) {
      algo = it->second;
      found = true;
    }
  }
  if (!found) {
    KESTREL_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&h.pref));
    const uint64_t wsb = ws_bytes;
    const uint32_t ua = al_a, ub = al_b, uc = al_c;
    KESTREL_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(h.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb,
                                                              sizeof(wsb)));
    KESTREL_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(h.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &ua,
                                                              sizeof(ua)));
    KESTREL_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(h.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ub,
                                                              sizeof(ub)));
    KESTREL_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(h.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &uc,
                                                              sizeof(uc)));
    KESTREL_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(h.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &uc,
                                                              sizeof(uc)));
    cublasLtMatmulHeuristicResult_t res{};
    int count = 0;
    KESTREL_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, h.desc, h.la, h.lb, h.lc, h.lc, h.pref, 1, &res, &count));
    KESTREL_CHECK(count > 0, "fp8_gemm", "cuBLASLt found no FP8 algorithm for [", M, ", ", K, "] (",
                  fp8_format_name(fa), ") . [", N, ", ", K, "]^T (", fp8_format_name(fb),
                  ") -> bf16 (FP8 GEMMs need sm_89 or newer)");
    algo = res.algo;
    std::lock_guard<std::mutex> lock(g_fp8_cache_mutex);
    g_fp8_algo_cache.emplace(key, algo);
  }
  const float alpha = 1.0f, beta = 0.0f;
  KESTREL_CUBLAS_CHECK(cublasLtMatmul(lt, h.desc, &alpha, b.data_ptr(), h.la, a.data_ptr(), h.lb, &beta, out.data_ptr(),
                                      h.lc, out.data_ptr(), h.lc, &algo, ws, ws_bytes, cuda::current_stream()));
}

}  // namespace

KESTREL_REGISTER_KERNEL(fp8_gemm, cuda, fp8_gemm_cuda);

}  // namespace kestrel::cuda_ops
