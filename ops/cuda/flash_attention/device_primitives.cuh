// Device primitives shared by the flash attention kernels: m16n8k16 mma.sync, ldmatrix,
// cp.async with zero fill, the swizzled shared-memory tile layout, vector reductions and the
// acquire/release counter operations of the deterministic backward.
//
// Shared tiles are row-major [rows][cols] of 16-bit elements, addressed in 16-byte chunks whose
// index is XOR-ed with the row so that the 8 rows an ldmatrix phase reads (or the 8 rows a
// fragment store writes) fall in distinct banks.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/flash_attention/flash_attention.h"

namespace kestrel::cuda::fa {

// ---- element types ----
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// ---- mma.sync m16n8k16, f32 accumulate: c += a * b ----
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- ldmatrix: lanes 8i..8i+7 give the row addresses of matrix i ----
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// ---- cp.async (L2 only, 16 bytes; src_size 0 writes zeros without reading) ----
__device__ __forceinline__ void cp_async_16(uint32_t smem, const void* gmem, bool pred) {
  int n = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_4(uint32_t smem, const void* gmem, bool pred) {
  int n = pred ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled tile with kCols 16-bit columns.
template <int kCols>
__device__ __forceinline__ uint32_t swz(int row, int chunk) {
  static_assert(kCols == 32 || kCols % 64 == 0, "swizzle needs 64-byte or >=128-byte rows");
  if constexpr (kCols >= 64) {
    return static_cast<uint32_t>(row * kCols * 2 + ((chunk ^ (row & 7)) << 4));
  } else {
    return static_cast<uint32_t>(row * kCols * 2 + ((chunk ^ ((row >> 1) & 3)) << 4));
  }
}

// Address of (row base_row + rc, chunk base_chunk ^ kc) given base = swz<kCols>(base_row, base_chunk):
// valid when rc is a multiple of 8 and kc's bits are disjoint from base_chunk's. Keeping one base
// register per access pattern and applying compile-time rc/kc here stops the unrolled loops from
// holding one precomputed address per (row, chunk) pair in registers.
template <int kCols>
__device__ __forceinline__ uint32_t swz_at(uint32_t base, int rc, int kc) {
  return (base ^ static_cast<uint32_t>(kc << 4)) + static_cast<uint32_t>(rc * kCols * 2);
}

// Copies a [kRows, kCols] tile of 16-bit elements from global memory (row stride `stride`
// elements) into a swizzled shared tile. Rows >= valid_rows and columns >= valid_cols are
// zero-filled (valid_cols is a multiple of 8).
template <int kRows, int kCols, int kThreads, typename T>
__device__ __forceinline__ void load_tile_async(uint32_t smem, const T* gmem, int64_t stride, int valid_rows,
                                                int valid_cols, int tid) {
  constexpr int kChunks = kCols / 8;
  constexpr int kTotal = kRows * kChunks;
  static_assert(kTotal % kThreads == 0, "tile must split evenly over the block");
#pragma unroll
  for (int it = 0; it < kTotal / kThreads; ++it) {
    int idx = it * kThreads + tid;
    int row = idx / kChunks;
    int ch = idx % kChunks;
    bool pred = row < valid_rows && ch * 8 < valid_cols;
    const T* src = pred ? gmem + row * stride + ch * 8 : gmem;
    cp_async_16(smem + swz<kCols>(row, ch), src, pred);
  }
}

// dst[0..1] += (x, y) as one vector reduction, issued only where `pred` holds. Predicated in PTX
// so that no branch (and no reconvergence barrier) separates the reductions from the GEMM code
// around them: ptxas can then interleave them with the next phase's ldmatrix/mma.
__device__ __forceinline__ void red_add_f32x2(float* dst, float x, float y, bool pred) {
  asm volatile(
      "{\n .reg .pred q;\n setp.ne.b32 q, %3, 0;\n @q red.global.add.v2.f32 [%0], {%1, %2};\n}\n" ::"l"(dst),
      "f"(x), "f"(y), "r"(static_cast<int>(pred)));
}

// ---- ordered accumulation (deterministic backward), CUTLASS's generic-barrier pattern ----
// Spins until *flag == expected (acquire at GPU scope: what the releasing block wrote before its
// release is visible afterwards). One thread calls it; a block barrier then releases the others.
__device__ __forceinline__ void wait_counter_eq(const int* flag, int expected) {
  int v;
  while (true) {
    asm volatile("ld.global.acquire.gpu.b32 %0, [%1];\n" : "=r"(v) : "l"(flag) : "memory");
    if (v == expected) break;
    __nanosleep(32);
  }
}
// *flag += 1 after everything this block wrote before the preceding block barrier (release at GPU
// scope). One thread calls it, after a barrier that every writer of the block passed.
__device__ __forceinline__ void release_counter_inc(int* flag) {
  asm volatile("fence.acq_rel.gpu;\nred.relaxed.gpu.global.add.s32 [%0], 1;\n" ::"l"(flag) : "memory");
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace kestrel::cuda::fa
