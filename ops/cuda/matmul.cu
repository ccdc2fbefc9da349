// CUDA matmul through cuBLASLt: the slot in kernels/matmul.h.
//
// out [B, M, N] row-major = alpha * a [B, M, K] @ b [B, K, N] (+ bias [N]) (+ beta * out).
// cuBLASLt is column-major, so we compute out^T (N x M, ld N) = b^T a^T: "A" of the cuBLASLt call is
// b and "B" is a. Each operand's transpose flag is read off its strides: a unit stride on the
// column dim is a plain column-major matrix, a unit stride on the row dim is the transposed one; an
// operand with neither (e.g. a doubly strided slice) is copied to contiguous first. Batches are
// strided (a batch stride of 0 shares the operand); a shared 2-D right operand with a row-major,
// batch-contiguous left operand is folded into one GEMM of B*M rows. Bias goes through the BIAS
// epilogue. f32 runs exact f32 unless the device's MemoryConfig::matmul_tf32 is on (memory.matmul_tf32,
// KESTREL_MATMUL_TF32; kestrel/runtime/memory_config.h): then CUBLAS_COMPUTE_32F_FAST_TF32.
//
// The descriptor, layouts and the heuristic's algorithm are one cached plan per (shapes, layouts,
// dtype, alignment, epilogue, device; cuda/cublaslt_plan.h); a call sets the bias pointer and launches.
#include <string>

#include "cuda/common.cuh"
#include "cuda/cublaslt_plan.h"
#include "kernels/matmul.h"

namespace kestrel::cuda_ops {
namespace {

struct LtOperand {
  cublasOperation_t op;
  uint64_t rows, cols;  // of the stored column-major matrix
  int64_t ld;
  int64_t batch_stride;
};

// [R, C] row-major-indexed operand with strides (sr, sc) as the cuBLASLt operand whose op() is C x R
// (the transpose of the row-major matrix). Returns false when neither stride is a unit stride.
bool as_lt_operand(int64_t R, int64_t C, int64_t sr, int64_t sc, int64_t sb, LtOperand* o) {
  if (sc == 1 || C == 1) {  // element (c, r) at c + r*sr: column-major C x R, no transpose
    int64_t ld = R == 1 ? C : sr;
    if (ld < C || ld <= 0) return false;
    *o = {CUBLAS_OP_N, static_cast<uint64_t>(C), static_cast<uint64_t>(R), ld, sb};
    return true;
  }
  if (sr == 1 || R == 1) {  // element (r, c) at r + c*sc: column-major R x C, transposed
    int64_t ld = C == 1 ? R : sc;
    if (ld < R || ld <= 0) return false;
    *o = {CUBLAS_OP_T, static_cast<uint64_t>(R), static_cast<uint64_t>(C), ld, sb};
    return true;
  }
  return false;
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::BF16: return CUDA_R_16BF;
    case DType::F16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

void make_layout(cublasLtMatrixLayout_t* l, cudaDataType_t t, uint64_t rows, uint64_t cols, int64_t ld, int64_t batch,
                 int64_t batch_stride) {
  const cuda::CublasLtApi& api = cuda::cublaslt_api();
  KESTREL_CUBLAS_CHECK(api.MatrixLayoutCreate(l, t, rows, cols, ld));
  if (batch > 1) {
    int32_t count = static_cast<int32_t>(batch);
    KESTREL_CUBLAS_CHECK(
        api.MatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    KESTREL_CUBLAS_CHECK(api.MatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                          &batch_stride, sizeof(batch_stride)));
  }
}

void matmul_cuda(const Tensor& out, const Tensor& a_in, const Tensor& b_in, const Tensor& bias_in, double alpha,
                 double beta) {
  DType dt = out.dtype();
  check_cuda_dtype(dt, "matmul");
  KESTREL_CHECK(a_in.dtype() == dt && b_in.dtype() == dt, "matmul", "operand dtypes differ from the output's ",
                dtype_name(dt));
  int64_t B = out.shape()[0], M = out.shape()[1], N = out.shape()[2], K = a_in.shape()[2];
  Tensor a = a_in, b = b_in;
  LtOperand la, lb;  // la: from b (cuBLASLt "A"), lb: from a (cuBLASLt "B")
  if (!as_lt_operand(K, N, b.strides()[1], b.strides()[2], b.strides()[0], &la)) {
    b = b.contiguous();
    as_lt_operand(K, N, b.strides()[1], b.strides()[2], b.strides()[0], &la);
  }
  if (!as_lt_operand(M, K, a.strides()[1], a.strides()[2], a.strides()[0], &lb)) {
    a = a.contiguous();
    as_lt_operand(M, K, a.strides()[1], a.strides()[2], a.strides()[0], &lb);
  }
  int64_t Mg = M, Bg = B;
  // Shared 2-D weight and a row-major left operand whose batches are back to back: one tall GEMM.
  if (B > 1 && la.batch_stride == 0 && lb.op == CUBLAS_OP_N && lb.batch_stride == M * lb.ld) {
    Mg = B * M;
    Bg = 1;
    lb.cols = static_cast<uint64_t>(Mg);
  }
  Tensor bias = bias_in.defined() ? bias_in.contiguous() : Tensor();

  bool tf32 = dt == DType::F32 && cuda::matmul_tf32();
  cublasComputeType_t compute = tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  cudaDataType_t ct = cuda_type(dt);
  size_t elt = dtype_size(dt);
  const int al_a = lt_alignment(b.data_ptr(), la.batch_stride * static_cast<int64_t>(elt), Bg);
  const int al_b = lt_alignment(a.data_ptr(), lb.batch_stride * static_cast<int64_t>(elt), Bg);
  int al_c = lt_alignment(out.data_ptr(), M * N * static_cast<int64_t>(elt), Bg);
  if (bias.defined()) al_c = std::min(al_c, lt_alignment(bias.data_ptr()));

  size_t ws_bytes = 0;
  void* ws = cuda::cublaslt_workspace(&ws_bytes);
  cublasLtHandle_t lt = cuda::cublaslt_handle();
  const std::string key =
      lt_plan_key("matmul", {static_cast<int64_t>(dt), tf32, bias.defined(), beta != 0.0, Bg, Mg, N, K, la.op, lb.op,
                             la.ld, lb.ld, la.batch_stride, lb.batch_stride, al_a, al_b, al_c, cuda::current_device(),
                             static_cast<int64_t>(ws_bytes)});
  LtPlan* plan = lt_find_plan(key);
  if (!plan) {
    auto fresh = std::make_unique<LtPlan>();
    const cuda::CublasLtApi& api = cuda::cublaslt_api();
    KESTREL_CUBLAS_CHECK(api.MatmulDescCreate(&fresh->desc, compute, CUDA_R_32F));
    KESTREL_CUBLAS_CHECK(
        api.MatmulDescSetAttribute(fresh->desc, CUBLASLT_MATMUL_DESC_TRANSA, &la.op, sizeof(la.op)));
    KESTREL_CUBLAS_CHECK(
        api.MatmulDescSetAttribute(fresh->desc, CUBLASLT_MATMUL_DESC_TRANSB, &lb.op, sizeof(lb.op)));
    if (bias.defined()) {
      // The pointer is set per call (lt_launch); the heuristic sees this call's.
      const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
      const void* bp = bias.data_ptr();
      KESTREL_CUBLAS_CHECK(
          api.MatmulDescSetAttribute(fresh->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
      KESTREL_CUBLAS_CHECK(
          api.MatmulDescSetAttribute(fresh->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof(bp)));
    }
    make_layout(&fresh->a, ct, la.rows, la.cols, la.ld, Bg, la.batch_stride);
    make_layout(&fresh->b, ct, lb.rows, lb.cols, lb.ld, Bg, lb.batch_stride);
    make_layout(&fresh->c, ct, static_cast<uint64_t>(N), static_cast<uint64_t>(Mg), N, Bg, M * N);
    lt_choose_algorithm(lt, *fresh, al_a, al_b, al_c, ws_bytes, "matmul",
                        detail::concat(dtype_name(dt), " [", B, ", ", M, ", ", K, "] @ [", K, ", ", N, "]"));
    plan = &lt_insert_plan(key, std::move(fresh));
  }
  const float alpha_f = static_cast<float>(alpha), beta_f = static_cast<float>(beta);
  if (bias.defined())
    lt_launch(lt, *plan, {{CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias.data_ptr()}}, &alpha_f, b.data_ptr(),
              a.data_ptr(), &beta_f, out.data_ptr(), ws, ws_bytes, cuda::current_stream());
  else
    lt_launch(lt, *plan, {}, &alpha_f, b.data_ptr(), a.data_ptr(), &beta_f, out.data_ptr(), ws, ws_bytes,
              cuda::current_stream());
}

}  // namespace

KESTREL_REGISTER_KERNEL(matmul, cuda, matmul_cuda);

}  // namespace kestrel::cuda_ops
