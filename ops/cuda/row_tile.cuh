// Private: a row of C elements held in registers across one block, for the one-pass row kernels
// (norms, softmax). Thread t holds chunks k < CH: columns [(k * blockDim.x + t) * V, + V), packed in
// the storage type (a bf16 chunk of 8 is 4 registers). The row is read from memory once; the
// statistics and the output are computed from the registers. Rows too long for CH chunks of the
// largest block take the kernels' streaming fallback (two passes, the second from L1/L2).
//
// Kept apart from common.cuh so that the flash-attention translation units do not depend on it.
#pragma once

#include <algorithm>
#include <map>
#include <utility>

#include "cuda/common.cuh"

namespace kestrel::cuda_ops {

// V elements in their storage type: one 16-byte access when V * sizeof(T) == 16, scalars otherwise.
template <typename T, int V>
struct alignas(V * sizeof(T)) Pack {
  T v[V];
};
template <typename T, int V>
__device__ __forceinline__ Pack<T, V> load_pack(const T* p) {
  Pack<T, V> r;
  if constexpr (V * sizeof(T) == 16) {
    *reinterpret_cast<int4*>(&r) = __ldg(reinterpret_cast<const int4*>(p));
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) r.v[j] = p[j];
  }
  return r;
}

template <typename T, int V>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, V>& v) {
  if constexpr (V * sizeof(T) == 16) {
    *reinterpret_cast<int4*>(p) = *reinterpret_cast<const int4*>(&v);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) p[j] = v.v[j];
  }
}

// First column of this thread's chunk k.
template <int V>
__device__ __forceinline__ int64_t chunk_col(int k) {
  return (static_cast<int64_t>(k) * blockDim.x + threadIdx.x) * V;
}

// Loads this thread's chunks of `row`; chunks past C are zero (so sums ignore them).
template <typename T, int V, int CH>
__device__ __forceinline__ void load_row(Pack<T, V> (&p)[CH], const T* row, int64_t C) {
#pragma unroll
  for (int k = 0; k < CH; ++k) {
    int64_t c = chunk_col<V>(k);
    if (c < C) {
      p[k] = load_pack<T, V>(row + c);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) p[k].v[j] = from_f32<T>(0.0f);
    }
  }
}

// Makes the compiler forget what `p` holds (an empty asm that "rewrites" every word). Called after a
// row's statistics, it stops the f32 copies of the row made for them from being kept live until the
// output is written: the kernel re-converts from the packed registers instead, which keeps register
// use (and so rows in flight per SM) at the packed size.
template <typename T, int V, int CH>
__device__ __forceinline__ void forget_values(Pack<T, V> (&p)[CH]) {
#pragma unroll
  for (int k = 0; k < CH; ++k) {
    if constexpr (sizeof(Pack<T, V>) % 4 == 0) {
      auto* w = reinterpret_cast<uint32_t*>(&p[k]);
#pragma unroll
      for (int i = 0; i < static_cast<int>(sizeof(Pack<T, V>) / 4); ++i) asm volatile("" : "+r"(w[i]));
    } else {
      auto* w = reinterpret_cast<uint16_t*>(&p[k]);
#pragma unroll
      for (int i = 0; i < static_cast<int>(sizeof(Pack<T, V>) / 2); ++i) asm volatile("" : "+h"(w[i]));
    }
  }
}

// Block-wide sums with one barrier per call (the row kernels call it once or twice per row). Two
// shared scratch buffers are used alternately: a buffer is rewritten two calls later, after a barrier
// that every thread reaches only once it has read the buffer. Every thread gets the same, fixed-order
// result. Each thread holds its own BlockSum (the phase is a register) over one shared buffer:
//   __shared__ BlockSum::Buffer buf;  BlockSum red{buf};
struct BlockSum {
  using Buffer = float[2][3][32];
  float (*buf)[3][32];
  int phase = 0;
  __device__ __forceinline__ explicit BlockSum(Buffer& b) : buf(b) {}
  // Sums N (<= 3) values at once over the block (blockDim.x a multiple of 32, <= 1024).
  template <int N>
  __device__ __forceinline__ void sum(float (&v)[N]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = warp_sum(v[i]);
    if (lane == 0)
#pragma unroll
      for (int i = 0; i < N; ++i) buf[phase][i][warp] = v[i];
    __syncthreads();
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = warp_sum(lane < nw ? buf[phase][i][lane] : 0.0f);
    phase ^= 1;
  }
  __device__ __forceinline__ float sum(float v) {
    float a[1] = {v};
    sum(a);
    return a[0];
  }
  __device__ __forceinline__ float max(float v) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    if (lane == 0) buf[phase][0][warp] = v;
    __syncthreads();
    v = warp_max(lane < nw ? buf[phase][0][lane] : -INFINITY);
    phase ^= 1;
    return v;
  }
};

constexpr int kRowMaxThreads = 512;  // kernels declare __launch_bounds__(kRowMaxThreads)
constexpr int kRowMaxChunks = 4;

// Block size and chunks per thread for a row kernel over rows of C elements in V-vectors: about two
// chunks per thread (64..512 threads). chunks > kRowMaxChunks: the row does not fit in registers.
struct RowLaunch {
  int threads, chunks;
};
inline RowLaunch row_launch(int64_t C, int V) {
  int64_t nvec = ceil_div(C, V);
  int64_t t = ceil_div(ceil_div(nvec, 2), 32) * 32;
  int threads = static_cast<int>(std::clamp<int64_t>(t, 64, kRowMaxThreads));
  return {threads, static_cast<int>(ceil_div(nvec, threads))};
}

// Grid of one resident wave of `kernel` at `threads` per block (occupancy from the compiled kernel's
// registers and shared memory; cached per thread), at most `rows` blocks. The row kernels walk the
// rows grid-stride, so a block's row set (and a backward's partial-sum layout) depends only on the
// shape and the device.
template <typename K>
unsigned resident_grid(K* kernel, int threads, int64_t rows) {
  thread_local std::map<std::pair<const void*, int>, int> cache;
  int dev = 0;
  KESTREL_CUDA_CHECK(cudaGetDevice(&dev));
  auto key = std::make_pair(reinterpret_cast<const void*>(kernel), threads * 64 + dev);
  auto it = cache.find(key);
  if (it == cache.end()) {
    int per_sm = 0;
    KESTREL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
    it = cache.emplace(key, std::max(per_sm, 1)).first;
  }
  return static_cast<unsigned>(std::clamp<int64_t>(rows, 1, static_cast<int64_t>(sm_count()) * it->second));
}

// Calls f(T{}, integral_constant<V>, integral_constant<CH>, RowLaunch) for rows of C elements of
// dtype dt: V the 16-byte width when C allows it and every pointer is aligned (else 1); CH = 2 or 4
// chunks in registers, or 0 for the streaming fallback (threads then 256).
template <typename F>
void dispatch_rows(DType dt, const char* op, int64_t C, std::initializer_list<const void*> ptrs, F&& f) {
  dispatch_cuda_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = Vec<T>::N;
    bool vec = C % N == 0;
    for (const void* p : ptrs) vec = vec && (p == nullptr || aligned16(p));
    auto with_v = [&](auto vtag) {
      constexpr int V = decltype(vtag)::value;
      RowLaunch L = row_launch(C, V);
      if (L.chunks <= 2) {
        f(tag, vtag, std::integral_constant<int, 2>{}, L);
      } else if (L.chunks <= kRowMaxChunks) {
        f(tag, vtag, std::integral_constant<int, 4>{}, L);
      } else {
        L.threads = 256;
        f(tag, vtag, std::integral_constant<int, 0>{}, L);
      }
    };
    if (vec)
      with_v(std::integral_constant<int, N>{});
    else
      with_v(std::integral_constant<int, 1>{});
  });
}

}  // namespace kestrel::cuda_ops
