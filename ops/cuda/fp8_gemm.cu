// CUDA FP8 GEMM through cuBLASLt (the fp8_gemm slot of kernels/fp8.h).
//
// out [M, N] row-major = (a [M, K] . b [N, K]^T) * a_scales[0] * b_scales[0], with a and b fp8
// row-major (K-contiguous). cuBLASLt is column-major: out^T (N x M, ld N) = op(A) op(B) with A = b
// (stored K x N, ld K, TRANSA = T) and B = a (stored K x M, ld K, TRANSB = N) — the "TN" layout that
// cuBLASLt's FP8 kernels require on sm_90. The dequantisation factors go in as device pointers
// (A_SCALE_POINTER / B_SCALE_POINTER), so nothing is read on the host. cuBLASLt refuses a scale pointer
// that is not 16-byte aligned (CUBLAS_STATUS_NOT_SUPPORTED from cublasLtMatmul after a successful
// heuristic; found on the H200 with a standalone A/B of the settings, 2026-12-01): an Fp8Tensor's
// dequantisation factor is the first element of its own scales allocation (fp8_cast, ops/src/fp8.cpp;
// the caching allocator hands out 512-byte aligned blocks), so the pointers go to cuBLASLt as they are,
// and a misaligned one (a hand-made view) is refused here before cuBLASLt sees it. D (and C, unused:
// beta = 0) is bf16, compute f32. FAST_ACCUM skips the periodic promotion of the tensor cores' partial
// sums to f32: faster, less accurate; linear_fp8 asks for it on the forward only.
// The descriptor, layouts and algorithm are one cached plan per (shapes, formats, fast_accum,
// alignment, workspace, device; cuda/cublaslt_plan.h): a call sets the two scale pointers and launches.
#include <string>

#include "cuda/common.cuh"
#include "cuda/cublaslt_plan.h"
#include "kernels/fp8.h"

namespace kestrel::cuda_ops {
namespace {

cudaDataType_t fp8_type(Fp8Format f) { return f == Fp8Format::E4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

void fp8_gemm_cuda(const Tensor& out, const Tensor& a, Fp8Format fa, const Tensor& a_scales, const Tensor& b,
                   Fp8Format fb, const Tensor& b_scales, bool fast_accum) {
  KESTREL_CHECK(out.dtype() == DType::BF16, "fp8_gemm", "the CUDA FP8 GEMM writes bf16, got ", dtype_name(out.dtype()));
  // cuBLASLt's A is our b, its B our a: the scale pointers follow.
  const void* sa = b_scales.data_ptr();
  const void* sb = a_scales.data_ptr();
  KESTREL_CHECK(lt_alignment(sa) >= 16 && lt_alignment(sb) >= 16, "fp8_gemm",
                "the dequantisation factors must be 16-byte aligned (cuBLASLt's scale pointers); a's is at ", sb,
                ", b's at ", sa, " (fp8_cast allocates them so; a view at an offset is not)");
  const int64_t M = a.shape()[0], K = a.shape()[1], N = b.shape()[0];
  const int al_a = lt_alignment(b.data_ptr()), al_b = lt_alignment(a.data_ptr()), al_c = lt_alignment(out.data_ptr());
  size_t ws_bytes = 0;
  void* ws = cuda::cublaslt_workspace(&ws_bytes);
  cublasLtHandle_t lt = cuda::cublaslt_handle();
  const int8_t fast = fast_accum ? 1 : 0;
  const std::string key =
      lt_plan_key("fp8_gemm", {M, N, K, static_cast<int64_t>(fa), static_cast<int64_t>(fb), fast, al_a, al_b, al_c,
                               cuda::current_device(), static_cast<int64_t>(ws_bytes)});
  LtPlan* plan = lt_find_plan(key);
  if (!plan) {
    auto fresh = std::make_unique<LtPlan>();
    const cuda::CublasLtApi& api = cuda::cublaslt_api();
    KESTREL_CUBLAS_CHECK(api.MatmulDescCreate(&fresh->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    KESTREL_CUBLAS_CHECK(api.MatmulDescSetAttribute(fresh->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    KESTREL_CUBLAS_CHECK(api.MatmulDescSetAttribute(fresh->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    // The scale pointers are set per call (lt_launch); the heuristic sees this call's.
    KESTREL_CUBLAS_CHECK(
        api.MatmulDescSetAttribute(fresh->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
    KESTREL_CUBLAS_CHECK(
        api.MatmulDescSetAttribute(fresh->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
    KESTREL_CUBLAS_CHECK(
        api.MatmulDescSetAttribute(fresh->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
    KESTREL_CUBLAS_CHECK(api.MatrixLayoutCreate(&fresh->a, fp8_type(fb), static_cast<uint64_t>(K),
                                                    static_cast<uint64_t>(N), K));
    KESTREL_CUBLAS_CHECK(api.MatrixLayoutCreate(&fresh->b, fp8_type(fa), static_cast<uint64_t>(K),
                                                    static_cast<uint64_t>(M), K));
    KESTREL_CUBLAS_CHECK(api.MatrixLayoutCreate(&fresh->c, CUDA_R_16BF, static_cast<uint64_t>(N),
                                                    static_cast<uint64_t>(M), N));
    lt_choose_algorithm(lt, *fresh, al_a, al_b, al_c, ws_bytes, "fp8_gemm",
                        detail::concat("[", M, ", ", K, "] (", fp8_format_name(fa), ") . [", N, ", ", K, "]^T (",
                                       fp8_format_name(fb), ") -> bf16 (FP8 GEMMs need sm_89 or newer)"));
    plan = &lt_insert_plan(key, std::move(fresh));
  }
  const float alpha = 1.0f, beta = 0.0f;
  lt_launch(lt, *plan, {{CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, sa}, {CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, sb}},
            &alpha, b.data_ptr(), a.data_ptr(), &beta, out.data_ptr(), ws, ws_bytes, cuda::current_stream());
}

}  // namespace

KESTREL_REGISTER_KERNEL(fp8_gemm, cuda, fp8_gemm_cuda);

}  // namespace kestrel::cuda_ops
