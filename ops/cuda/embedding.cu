// CUDA row gather/scatter kernels (embedding, index_select_rows, splice_rows) for the slots in
// kernels/embedding.h. Rows are [rows, R] contiguous; indices [M] i32/i64, range-checked by the op.
//
// gather / scatter: one thread per 16 bytes when rows are 16-byte multiples and aligned, else per
// element (rows copied as raw bits, no rounding).
// scatter_add (embedding backward):
// - default: atomics into dst (f32 atomicAdd; bf16/f16 use the native 16-bit atomics, so each add
//   rounds: order-dependent in the last bits); on sm_90 with 16-byte rows, 16 bytes per vector
//   reduction instruction (the same per-element adds);
// - deterministic, sort-free: block b owns dst rows [b*RB, (b+1)*RB) and scans the whole index list in
//   order (tiles of blockDim, ordered compaction by warp ballots), adding each matching source row into
//   an f32 shared-memory accumulator [RB, R] in increasing m; at the end dst rows that matched get
//   dst + acc, rounded once. Each (row, column) sums in index order: bitwise reproducible.
#include <algorithm>
#include <type_traits>

#include "cuda/common.cuh"
#include "kernels/embedding.h"

namespace kestrel::cuda_ops {
namespace {

constexpr int kBlock = 256;

template <typename I>
__global__ void first_bad_kernel(const I* __restrict__ idx, int64_t M, int64_t n, unsigned long long* out) {
  for (int64_t m = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; m < M;
       m += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t v = static_cast<int64_t>(idx[m]);
    if (v < 0 || v >= n) atomicMin(out, static_cast<unsigned long long>(m));
  }
}

__device__ __forceinline__ int64_t index_at(const void* idx, bool i64, int64_t m) {
  return i64 ? static_cast<const int64_t*>(idx)[m] : static_cast<int64_t>(static_cast<const int32_t*>(idx)[m]);
}

// dst[dst_row(m), :] = src[src_row(m), :] with W-typed words; rows are `words` words long.
// GATHER: dst row m <- src row idx[m]; else dst row idx[m] <- src row m.
template <typename W, bool GATHER>
__global__ void move_rows_kernel(W* __restrict__ dst, const W* __restrict__ src, const void* __restrict__ idx,
                                 bool i64, int64_t M, int64_t words) {
  int64_t total = M * words;
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < total;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t m = q / words, w = q % words, r = index_at(idx, i64, m);
    if (GATHER)
      dst[m * words + w] = src[r * words + w];
    else
      dst[r * words + w] = src[m * words + w];
  }
}

template <bool GATHER>
void move_rows(const Tensor& dst, const Tensor& src, const Tensor& idx, const char* op) {
  int64_t M = idx.numel();
  const Tensor& rows_t = GATHER ? dst : src;  // the [M, R] side
  int64_t row_bytes = rows_t.numel() / std::max<int64_t>(M, 1) * static_cast<int64_t>(dtype_size(rows_t.dtype()));
  if (M == 0 || row_bytes == 0) return;
  bool i64 = idx.dtype() == DType::I64;
  cudaStream_t s = cuda::current_stream();
  auto go = [&](auto word) {
    using W = decltype(word);
    int64_t words = row_bytes / static_cast<int64_t>(sizeof(W));
    move_rows_kernel<W, GATHER><<<grid_for(M * words, kBlock), kBlock, 0, s>>>(
        static_cast<W*>(dst.data_ptr()), static_cast<const W*>(src.data_ptr()), idx.data_ptr(), i64, M, words);
  };
  bool al = aligned16(dst.data_ptr()) && aligned16(src.data_ptr());
  if (row_bytes % 16 == 0 && al)
    go(int4{});
  else if (row_bytes % 4 == 0 && (reinterpret_cast<uintptr_t>(dst.data_ptr()) % 4 == 0) &&
           (reinterpret_cast<uintptr_t>(src.data_ptr()) % 4 == 0))
    go(uint32_t{});
  else
    go(uint16_t{});
  KESTREL_CUDA_CHECK_LAUNCH();
  (void)op;
}

// ---- scatter-add ----
__device__ __forceinline__ void atomic_add(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(bf16_t* p, float v) { atomicAdd(p, __float2bfloat16_rn(v)); }
__device__ __forceinline__ void atomic_add(f16_t* p, float v) { atomicAdd(p, __float2half_rn(v)); }

template <typename T>
__global__ void scatter_add_atomic_kernel(T* __restrict__ dst, const T* __restrict__ src, const void* __restrict__ idx,
                                          bool i64, int64_t M, int64_t R) {
  int64_t total = M * R;
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < total;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t m = q / R, c = q % R;
    atomic_add(dst + index_at(idx, i64, m) * R + c, to_f32(src[q]));
  }
}

// The same adds 16 bytes at a time (rows of a multiple of 16 bytes, both bases 16-byte aligned): one
// vector reduction per 8 bf16/f16 (red.global.add.noftz.v4.{bf16x2,f16x2}) or 4 f32 (red...v4.f32),
// sm_90. Each element is still one atomic add with one rounding, as in the scalar kernel; only the
// number of reduction instructions drops (8x for 16-bit rows: the 1.5B step's embedding backward was
// 16.8M scalar bf16 atomics, 3.0 ms). Built for an older arch, the same kernel adds element by element.
// Adds the 16 bytes at `v` (elements of T) into p[0..16 / sizeof(T)).
template <typename T>
__device__ __forceinline__ void red_add16(T* p, const uint4& v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (std::is_same_v<T, bf16_t>) {
    asm volatile("red.global.add.noftz.v4.bf16x2 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
  } else if constexpr (std::is_same_v<T, f16_t>) {
    asm volatile("red.global.add.noftz.v4.f16x2 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
  } else {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(__uint_as_float(v.x)),
                 "f"(__uint_as_float(v.y)), "f"(__uint_as_float(v.z)), "f"(__uint_as_float(v.w))
                 : "memory");
  }
#else
  const T* e = reinterpret_cast<const T*>(&v);
  for (size_t i = 0; i < 16 / sizeof(T); ++i) atomic_add(p + i, to_f32(e[i]));
#endif
}

template <typename T>
__global__ void scatter_add_vec_kernel(T* __restrict__ dst, const T* __restrict__ src, const void* __restrict__ idx,
                                       bool i64, int64_t M, int64_t R) {
  constexpr int64_t kPer = 16 / sizeof(T);  // elements per 16 bytes
  const int64_t vecs = R / kPer, total = M * vecs;
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < total;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t m = q / vecs, c = (q % vecs) * kPer;
    const uint4 v = *reinterpret_cast<const uint4*>(src + m * R + c);
    red_add16(dst + index_at(idx, i64, m) * R + c, v);
  }
}

// Deterministic: block owns dst rows [v0, v0 + RB); acc [RB, R] f32 in dynamic shared memory.
template <typename T>
__global__ void scatter_add_det_kernel(T* __restrict__ dst, const T* __restrict__ src, const void* __restrict__ idx,
                                       bool i64, int64_t M, int64_t R, int64_t V, int RB) {
  extern __shared__ float smem[];
  float* acc = smem;                               // [RB, R]
  int* matches = reinterpret_cast<int*>(acc + RB * R);  // [blockDim.x]: m - m0 of this tile's matches, in order
  __shared__ int warp_count[32];
  __shared__ int touched[32];
  __shared__ int n_match;
  int64_t v0 = static_cast<int64_t>(blockIdx.x) * RB;
  for (int64_t e = threadIdx.x; e < RB * R; e += blockDim.x) acc[e] = 0.0f;
  if (threadIdx.x < 32) touched[threadIdx.x] = 0;
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int64_t m0 = 0; m0 < M; m0 += blockDim.x) {
    int64_t m = m0 + threadIdx.x;
    int64_t v = m < M ? index_at(idx, i64, m) : -1;
    bool hit = v >= v0 && v < v0 + RB;
    unsigned ballot = __ballot_sync(0xffffffffu, hit);
    __syncthreads();  // previous tile's matches consumed
    if (lane == 0) warp_count[warp] = __popc(ballot);
    __syncthreads();
    if (threadIdx.x == 0) {
      int total = 0;
      for (int w = 0; w < nw; ++w) {
        int c = warp_count[w];
        warp_count[w] = total;
        total += c;
      }
      n_match = total;
    }
    __syncthreads();
    if (hit) {
      matches[warp_count[warp] + __popc(ballot & ((1u << lane) - 1u))] = threadIdx.x;
      touched[v - v0] = 1;
    }
    __syncthreads();
    for (int k = 0; k < n_match; ++k) {
      int64_t mm = m0 + matches[k];
      int64_t row = index_at(idx, i64, mm) - v0;
      const T* sr = src + mm * R;
      for (int64_t c = threadIdx.x; c < R; c += blockDim.x) acc[row * R + c] += to_f32(sr[c]);
    }
  }
  __syncthreads();
  for (int r = 0; r < RB && v0 + r < V; ++r) {
    if (!touched[r]) continue;
    T* dr = dst + (v0 + r) * R;
    for (int64_t c = threadIdx.x; c < R; c += blockDim.x) dr[c] = from_f32<T>(to_f32(dr[c]) + acc[r * R + c]);
  }
}

int64_t first_bad_index_cuda(const Tensor& idx, int64_t n) {
  int64_t M = idx.numel();
  if (M == 0) return -1;
  Tensor flag = Tensor::full({1}, -1.0, DType::I64, idx.device());  // all ones as u64 = max
  cudaStream_t s = cuda::current_stream();
  auto* out = static_cast<unsigned long long*>(flag.data_ptr());
  if (idx.dtype() == DType::I64)
    first_bad_kernel<int64_t><<<grid_for(M, kBlock), kBlock, 0, s>>>(ptr<const int64_t>(idx), M, n, out);
  else
    first_bad_kernel<int32_t><<<grid_for(M, kBlock), kBlock, 0, s>>>(ptr<const int32_t>(idx), M, n, out);
  KESTREL_CUDA_CHECK_LAUNCH();
  return flag.to(Device::cpu()).to_int_vector()[0];  // -1 when untouched
}

void gather_rows_cuda(const Tensor& out, const Tensor& x, const Tensor& idx) { move_rows<true>(out, x, idx, "gather"); }
void scatter_rows_cuda(const Tensor& dst, const Tensor& src, const Tensor& idx) {
  move_rows<false>(dst, src, idx, "scatter");
}

void scatter_add_rows_cuda(const Tensor& dst, const Tensor& src, const Tensor& idx, bool deterministic) {
  int64_t M = idx.numel(), V = dst.shape()[0], R = dst.numel() / std::max<int64_t>(V, 1);
  if (M == 0 || R == 0) return;
  bool i64 = idx.dtype() == DType::I64;
  cudaStream_t s = cuda::current_stream();
  dispatch_cuda_float(dst.dtype(), "scatter_add_rows", [&](auto tag) {
    using T = decltype(tag);
    if (!deterministic && (R * sizeof(T)) % 16 == 0 && aligned16(dst.data_ptr()) && aligned16(src.data_ptr())) {
      const int64_t vecs = M * R / (16 / static_cast<int64_t>(sizeof(T)));
      scatter_add_vec_kernel<T><<<grid_for(vecs, kBlock), kBlock, 0, s>>>(ptr<T>(dst), ptr<const T>(src),
                                                                          idx.data_ptr(), i64, M, R);
      return;
    }
    if (!deterministic) {
      scatter_add_atomic_kernel<T><<<grid_for(M * R, kBlock), kBlock, 0, s>>>(ptr<T>(dst), ptr<const T>(src),
                                                                              idx.data_ptr(), i64, M, R);
      return;
    }
    const size_t budget = 96 * 1024;  // f32 accumulator bytes per block
    int64_t rb = std::clamp<int64_t>(static_cast<int64_t>(budget / (4 * R)), 1, 32);
    size_t smem = static_cast<size_t>(rb * R) * 4 + kBlock * sizeof(int);
    KESTREL_CHECK(smem <= 200 * 1024, "embedding", "deterministic backward supports rows of at most ~50k elements, got ",
                  R);
    KESTREL_CUDA_CHECK(cudaFuncSetAttribute(scatter_add_det_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
    unsigned grid = static_cast<unsigned>(ceil_div(V, rb));
    scatter_add_det_kernel<T><<<grid, kBlock, smem, s>>>(ptr<T>(dst), ptr<const T>(src), idx.data_ptr(), i64, M, R, V,
                                                         static_cast<int>(rb));
  });
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace

KESTREL_REGISTER_KERNEL(first_bad_index, cuda, first_bad_index_cuda);
KESTREL_REGISTER_KERNEL(gather_rows, cuda, gather_rows_cuda);
KESTREL_REGISTER_KERNEL(scatter_add_rows, cuda, scatter_add_rows_cuda);
KESTREL_REGISTER_KERNEL(scatter_rows, cuda, scatter_rows_cuda);

}  // namespace kestrel::cuda_ops
