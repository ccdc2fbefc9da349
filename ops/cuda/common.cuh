// Private: shared device helpers for the op kernels in ops/cuda/*.cu.
//
// - element types: f32 / bf16 / f16 storage, computed in f32 (f64 on CUDA is a clear error);
// - 16-byte vectors (Vec<T>) for the contiguous fast paths, with a scalar tail;
// - a strided indexer (rank <= 8) for the generic fallback: linear index -> element offsets;
// - warp/block sum and max reductions;
// - the host-side dtype switch (dispatch_cuda_float) and launch-size helpers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <type_traits>

#include "kestrel/cuda/check.h"
#include "kestrel/cuda/context.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::cuda_ops {

using bf16_t = __nv_bfloat16;
using f16_t = __half;

// ---- element conversions ----
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(bf16_t v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(f16_t v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_f32(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else if constexpr (std::is_same_v<T, bf16_t>) return __float2bfloat16_rn(v);
  else return __float2half_rn(v);
}

// Runtime-typed load/store for the generic (mixed dtype / strided) paths.
__device__ __forceinline__ float load_as_f32(const void* p, int64_t i, DType t) {
  switch (t) {
    case DType::BF16: return __bfloat162float(static_cast<const bf16_t*>(p)[i]);
    case DType::F16: return __half2float(static_cast<const f16_t*>(p)[i]);
    case DType::I32: return static_cast<float>(static_cast<const int32_t*>(p)[i]);
    case DType::I64: return static_cast<float>(static_cast<const int64_t*>(p)[i]);
    case DType::U8: return static_cast<float>(static_cast<const uint8_t*>(p)[i]);
    case DType::Bool: return static_cast<const uint8_t*>(p)[i] != 0 ? 1.0f : 0.0f;
    default: return static_cast<const float*>(p)[i];
  }
}
__device__ __forceinline__ void store_f32_as(void* p, int64_t i, DType t, float v) {
  switch (t) {
    case DType::BF16: static_cast<bf16_t*>(p)[i] = __float2bfloat16_rn(v); break;
    case DType::F16: static_cast<f16_t*>(p)[i] = __float2half_rn(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

// ---- 16-byte vectors ----
template <typename T>
struct alignas(16) Vec {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

template <typename T>
__device__ __forceinline__ Vec<T> load_vec(const T* p) {
  Vec<T> r;
  *reinterpret_cast<int4*>(&r) = __ldg(reinterpret_cast<const int4*>(p));
  return r;
}
template <typename T>
__device__ __forceinline__ void store_vec(T* p, const Vec<T>& v) {
  *reinterpret_cast<int4*>(p) = *reinterpret_cast<const int4*>(&v);
}

// V consecutive elements to/from f32 registers: one 16-byte access when V is the vector width,
// V scalar accesses otherwise (V = 1: the unaligned fallback).
template <typename T, int V>
__device__ __forceinline__ void load_chunk(const T* p, float (&f)[V]) {
  if constexpr (V == Vec<T>::N) {
    Vec<T> v = load_vec(p);
#pragma unroll
    for (int j = 0; j < V; ++j) f[j] = to_f32(v.v[j]);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) f[j] = to_f32(p[j]);
  }
}
template <typename T, int V>
__device__ __forceinline__ void store_chunk(T* p, const float (&f)[V]) {
  if constexpr (V == Vec<T>::N) {
    Vec<T> v;
#pragma unroll
    for (int j = 0; j < V; ++j) v.v[j] = from_f32<T>(f[j]);
    store_vec(p, v);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) p[j] = from_f32<T>(f[j]);
  }
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// ---- strided indexing ----
constexpr int kMaxRank = 8;

// Shape plus K operands' strides, coalesced (adjacent dims merged when every operand allows it).
template <int K>
struct Indexer {
  int rank = 0;
  int64_t sizes[kMaxRank];
  int64_t strides[K][kMaxRank];

  __device__ __forceinline__ void offsets(int64_t linear, int64_t (&off)[K]) const {
#pragma unroll
    for (int k = 0; k < K; ++k) off[k] = 0;
    for (int d = rank - 1; d >= 0; --d) {
      int64_t idx = linear % sizes[d];
      linear /= sizes[d];
#pragma unroll
      for (int k = 0; k < K; ++k) off[k] += idx * strides[k][d];
    }
  }
};

// Builds an indexer over `shape` for K stride lists (in elements, storage offsets excluded).
template <int K>
Indexer<K> make_indexer(const Shape& shape, const std::array<const Strides*, K>& ss, const char* op) {
  Indexer<K> ix;
  // Drop size-1 dims, then merge dim d into d+1 when contiguous for every operand.
  KESTREL_CHECK(shape.size() <= 32, op, "rank ", shape.size(), " is too large");
  int64_t sz[32];
  int64_t st[K][32];
  int n = 0;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    sz[n] = shape[d];
    for (int k = 0; k < K; ++k) st[k][n] = (*ss[k])[d];
    ++n;
  }
  int m = 0;
  for (int d = 0; d < n; ++d) {
    if (m > 0) {
      bool merge = true;
      for (int k = 0; k < K; ++k)
        if (st[k][m - 1] != st[k][d] * sz[d]) merge = false;
      if (merge) {
        sz[m - 1] *= sz[d];
        for (int k = 0; k < K; ++k) st[k][m - 1] = st[k][d];
        continue;
      }
    }
    sz[m] = sz[d];
    for (int k = 0; k < K; ++k) st[k][m] = st[k][d];
    ++m;
  }
  KESTREL_CHECK(m <= kMaxRank, op, "tensors of rank > ", kMaxRank, " after coalescing are not supported on CUDA");
  ix.rank = m;
  for (int d = 0; d < m; ++d) {
    ix.sizes[d] = sz[d];
    for (int k = 0; k < K; ++k) ix.strides[k][d] = st[k][d];
  }
  return ix;
}
template <int K>
Indexer<K> make_indexer(const Shape& shape, const std::array<const Tensor*, K>& ts, const char* op) {
  std::array<const Strides*, K> ss;
  for (int k = 0; k < K; ++k) ss[k] = &ts[k]->strides();
  return make_indexer<K>(shape, ss, op);
}

// ---- reductions ----
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
// `scratch` holds 32 floats; the call contains __syncthreads and may be repeated.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = lane < nwarps ? scratch[lane] : 0.0f;
  return warp_sum(r);
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = lane < nwarps ? scratch[lane] : -INFINITY;
  return warp_max(r);
}

// ---- host helpers ----
inline void check_cuda_dtype(DType t, const char* op) {
  KESTREL_CHECK(t != DType::F64, op, "f64 tensors are not supported on CUDA (use f32, bf16 or f16)");
  KESTREL_CHECK(t == DType::F32 || t == DType::BF16 || t == DType::F16, op,
                "expected a floating dtype (f32, bf16, f16) on CUDA, got ", dtype_name(t));
}

// f(T{}) with T the device element type of a floating dtype (f32, bf16, f16).
template <typename F>
decltype(auto) dispatch_cuda_float(DType t, const char* op, F&& f) {
  check_cuda_dtype(t, op);
  switch (t) {
    case DType::BF16: return f(bf16_t{});
    case DType::F16: return f(f16_t{});
    default: return f(float{});
  }
}

template <typename T>
T* ptr(const Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
// Streaming multiprocessors of the current device (read once per device).
using cuda::sm_count;
// Grid for a grid-stride loop over n work items: enough blocks to fill the device (16 per SM), no more.
inline unsigned grid_for(int64_t n, int block) {
  const int64_t g = ceil_div(n, block), cap = int64_t{16} * sm_count();
  return static_cast<unsigned>(g < cap ? (g < 1 ? 1 : g) : cap);
}

}  // namespace kestrel::cuda_ops
