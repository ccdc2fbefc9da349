// Private: the cuBLASLt plan cache shared by the GEMM launchers (matmul.cu, fp8_gemm.cu and
// fused_linear_cross_entropy_gemm.cu). They call cuBLASLt through cuda::cublaslt_api() (opened at
// run time; kestrel/cuda/cublaslt_api.h), never by its symbols: libkestrel does not link it.
//
// A plan is what one GEMM configuration needs from cuBLASLt: the matmul descriptor, the A, B and C
// layouts (D is written in C's layout) and the heuristic's algorithm. It is built once per key and
// kept until the process exits; the key must hold everything the descriptor, the layouts and the
// heuristic depend on (shapes, leading dimensions, batch strides, types, epilogue, operand pointer
// alignments, workspace bytes, device). The heuristic is told the operands' real alignments
// (MIN_ALIGNMENT_*; it assumes 256-byte aligned buffers otherwise, and views need not be) and the
// context's workspace, so its algorithm runs on any call with the same key.
//
// Pointers that change from call to call and live in the descriptor (a bias, FP8 scale factors) are
// set on the cached descriptor by each call: lt_launch sets them and enqueues the matmul under the
// plan's own mutex, so two threads running one plan cannot interleave (plans do not wait on each
// other, and a lookup holds the cache's lock only while it finds or inserts a plan).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>

#include "kestrel/cuda/cublaslt_api.h"

namespace kestrel::cuda_ops {

struct LtPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::mutex launch_mutex;  // held by lt_launch while it sets pointer attributes and enqueues

  LtPlan() = default;
  LtPlan(const LtPlan&) = delete;
  LtPlan& operator=(const LtPlan&) = delete;
  ~LtPlan();
};

// The largest power of two up to 256 dividing the address (and, for batch > 1, the batch stride in
// bytes): what the heuristic may assume about an operand.
int lt_alignment(const void* p, int64_t batch_stride_bytes = 0, int64_t batch = 1);

// A cache key: the caller's name (so two launchers' keys never collide) and the bytes of integer
// parts. Callers list every part the plan depends on.
std::string lt_plan_key(const char* op, std::initializer_list<int64_t> parts);

// The cached plan for `key`, or nullptr.
LtPlan* lt_find_plan(const std::string& key);
// Runs the heuristic for a plan whose descriptor and layouts are built: the workspace limit and the
// alignments (C's also for D) as preferences; the first algorithm goes into plan.algo. No algorithm is
// a kestrel::Error "[op] cuBLASLt found no algorithm for <what>".
void lt_choose_algorithm(cublasLtHandle_t lt, LtPlan& plan, int align_a, int align_b, int align_c,
                         size_t workspace_bytes, const char* op, const std::string& what);
// Stores a built plan under `key` and returns the cached one (a plan another thread stored first
// wins; `plan` is then dropped).
LtPlan& lt_insert_plan(const std::string& key, std::unique_ptr<LtPlan> plan);

// A pointer-valued descriptor attribute a call sets (bias, scale pointers).
struct LtPointerAttribute {
  cublasLtMatmulDescAttributes_t attribute;
  const void* value;
};
// D = alpha op(A) op(B) + beta C with C = D, on `stream`: sets `pointers` on the plan's descriptor
// and enqueues, under the plan's mutex.
void lt_launch(cublasLtHandle_t lt, LtPlan& plan, std::initializer_list<LtPointerAttribute> pointers,
               const float* alpha, const void* a, const void* b, const float* beta, void* d, void* workspace,
               size_t workspace_bytes, cudaStream_t stream);

}  // namespace kestrel::cuda_ops
