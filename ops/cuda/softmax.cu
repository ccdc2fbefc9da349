// CUDA softmax family (softmax / log_softmax forward and backward, logsumexp, amax with its backward)
// for the slots in kernels/softmax.h. The reduced dim is addressed as [outer, n, inner] (contiguous).
//
// inner == 1 (the last dim, the common case): one block per row (grid-stride, one resident wave);
// rows up to 16k bf16 / 8k f32 are held in registers (row_tile.cuh), read once: block max, block sum
// of exp, write. Longer rows: an online (max, sum-exp) pass merged across the block, then a second
// pass from L1/L2. 16-byte vector accesses when n is a multiple of the width and pointers are aligned.
// inner > 1: one thread per (outer, inner) column walking n with stride inner (coalesced over inner).
// f32 math; a row that is all -inf gives NaN softmax, as the CPU reference does.
#include <algorithm>

#include "cuda/row_tile.cuh"
#include "kernels/softmax.h"

namespace kestrel::cuda_ops {
namespace {
using kernels::ReduceDim;

constexpr int kBlock = 256;

struct MaxSum {
  float m, s;
};
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.s * __expf(a.m - m) + b.s * __expf(b.m - m)};
}
__device__ __forceinline__ MaxSum block_merge(MaxSum v, float* sm, float* ss) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)};
    v = merge(v, other);
  }
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) {
    sm[warp] = v.m;
    ss[warp] = v.s;
  }
  __syncthreads();
  MaxSum r = lane < nw ? MaxSum{sm[lane], ss[lane]} : MaxSum{-INFINITY, 0.0f};
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, r.m, o), __shfl_xor_sync(0xffffffffu, r.s, o)};
    r = merge(r, other);
  }
  return r;
}

// MODE 0: softmax, 1: log_softmax, 2: logsumexp (one value per row into out[r]).
// CH > 0: the row is held in registers (row_tile.cuh): max, then sum of exp, then the output, from
// one read. CH == 0 (long rows): an online (max, sum-exp) pass, then a second pass from L1/L2.
// The 2-chunk instantiation is held to 32 registers (4 blocks of 512 per SM instead of 3; no spills):
// 0.184 -> 0.177 ms at 16384 x 8192 bf16. Max and sum-exp use BlockSum (one barrier each, not two).
template <typename T, int V, int CH, int MODE>
__global__ __launch_bounds__(kRowMaxThreads, CH == 2 ? 4 : 1) void softmax_row_kernel(T* __restrict__ out,
                                                                                     const T* __restrict__ x,
                                                                                     int64_t rows, int64_t n) {
  __shared__ float sm[32], ss[32];
  __shared__ BlockSum::Buffer red_buf;
  BlockSum red(red_buf);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * n;
    MaxSum t;
    if constexpr (CH > 0) {
      Pack<T, V> xv[CH];
      load_row(xv, xr, n);
      float m = -INFINITY;
#pragma unroll
      for (int k = 0; k < CH; ++k)
        if (chunk_col<V>(k) < n)
#pragma unroll
          for (int j = 0; j < V; ++j) m = fmaxf(m, to_f32(xv[k].v[j]));
      m = red.max(m);
      float e = 0.0f;
      if (m != -INFINITY) {
#pragma unroll
        for (int k = 0; k < CH; ++k)
          if (chunk_col<V>(k) < n)
#pragma unroll
            for (int j = 0; j < V; ++j) e += __expf(to_f32(xv[k].v[j]) - m);
      }
      t = {m, red.sum(e)};
      if constexpr (MODE == 2) {
        if (threadIdx.x == 0) out[r] = from_f32<T>(t.m + logf(t.s));
      } else {
        float inv = 1.0f / t.s, lse = t.m + logf(t.s);
#pragma unroll
        for (int k = 0; k < CH; ++k) {
          int64_t c = chunk_col<V>(k);
          if (c >= n) continue;
          float v[V];
#pragma unroll
          for (int j = 0; j < V; ++j) {
            float xj = to_f32(xv[k].v[j]);
            v[j] = MODE == 0 ? __expf(xj - t.m) * inv : xj - lse;
          }
          store_chunk<T, V>(out + r * n + c, v);
        }
      }
    } else {
      MaxSum acc{-INFINITY, 0.0f};
      for (int64_t c = threadIdx.x * V; c < n; c += blockDim.x * V) {
        float v[V];
        load_chunk<T, V>(xr + c, v);
#pragma unroll
        for (int j = 0; j < V; ++j) acc = merge(acc, MaxSum{v[j], 1.0f});
      }
      t = block_merge(acc, sm, ss);
      if constexpr (MODE == 2) {
        if (threadIdx.x == 0) out[r] = from_f32<T>(t.m + logf(t.s));
      } else {
        float inv = 1.0f / t.s, lse = t.m + logf(t.s);
        for (int64_t c = threadIdx.x * V; c < n; c += blockDim.x * V) {
          float v[V];
          load_chunk<T, V>(xr + c, v);
#pragma unroll
          for (int j = 0; j < V; ++j) v[j] = MODE == 0 ? __expf(v[j] - t.m) * inv : v[j] - lse;
          store_chunk<T, V>(out + r * n + c, v);
        }
      }
    }
  }
}

template <typename T, int MODE>
__global__ void softmax_col_kernel(T* __restrict__ out, const T* __restrict__ x, ReduceDim rd) {
  int64_t cols = rd.outer * rd.inner;
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < cols;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t o = q / rd.inner, i = q % rd.inner, base = o * rd.n * rd.inner + i;
    MaxSum acc{-INFINITY, 0.0f};
    for (int64_t j = 0; j < rd.n; ++j) acc = merge(acc, MaxSum{to_f32(x[base + j * rd.inner]), 1.0f});
    float lse = acc.m + logf(acc.s);
    if constexpr (MODE == 2) {
      out[q] = from_f32<T>(lse);
    } else {
      for (int64_t j = 0; j < rd.n; ++j) {
        float v = to_f32(x[base + j * rd.inner]);
        out[base + j * rd.inner] = from_f32<T>(MODE == 0 ? __expf(v - lse) : v - lse);
      }
    }
  }
}

// dx = y * (dy - sum(dy * y))  or (LOG) dx = dy - exp(y) * sum(dy). CH as in softmax_row_kernel.
template <typename T, int V, int CH, bool LOG>
__global__ __launch_bounds__(kRowMaxThreads) void softmax_backward_row_kernel(T* __restrict__ dx,
                                                                             const T* __restrict__ y,
                                                                             const T* __restrict__ dy, int64_t rows,
                                                                             int64_t n) {
  __shared__ float scratch[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T *yr = y + r * n, *gr = dy + r * n;
    float dot = 0.0f;
    if constexpr (CH > 0) {
      Pack<T, V> yv[CH], gv[CH];
      load_row(yv, yr, n);  // chunks past n are zero: they add nothing to the dot product
      load_row(gv, gr, n);
#pragma unroll
      for (int k = 0; k < CH; ++k)
#pragma unroll
        for (int j = 0; j < V; ++j) dot += LOG ? to_f32(gv[k].v[j]) : to_f32(gv[k].v[j]) * to_f32(yv[k].v[j]);
      dot = block_sum(dot, scratch);
#pragma unroll
      for (int k = 0; k < CH; ++k) {
        int64_t c = chunk_col<V>(k);
        if (c >= n) continue;
        float o[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          float yj = to_f32(yv[k].v[j]), g = to_f32(gv[k].v[j]);
          o[j] = LOG ? g - __expf(yj) * dot : yj * (g - dot);
        }
        store_chunk<T, V>(dx + r * n + c, o);
      }
    } else {
      for (int64_t c = threadIdx.x * V; c < n; c += blockDim.x * V) {
        float yv[V], gv[V];
        load_chunk<T, V>(yr + c, yv);
        load_chunk<T, V>(gr + c, gv);
#pragma unroll
        for (int j = 0; j < V; ++j) dot += LOG ? gv[j] : gv[j] * yv[j];
      }
      dot = block_sum(dot, scratch);
      for (int64_t c = threadIdx.x * V; c < n; c += blockDim.x * V) {
        float yv[V], gv[V];
        load_chunk<T, V>(yr + c, yv);
        load_chunk<T, V>(gr + c, gv);
#pragma unroll
        for (int j = 0; j < V; ++j) gv[j] = LOG ? gv[j] - __expf(yv[j]) * dot : yv[j] * (gv[j] - dot);
        store_chunk<T, V>(dx + r * n + c, gv);
      }
    }
  }
}

template <typename T, bool LOG>
__global__ void softmax_backward_col_kernel(T* __restrict__ dx, const T* __restrict__ y, const T* __restrict__ dy,
                                            ReduceDim rd) {
  int64_t cols = rd.outer * rd.inner;
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < cols;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t base = (q / rd.inner) * rd.n * rd.inner + q % rd.inner;
    float dot = 0.0f;
    for (int64_t j = 0; j < rd.n; ++j) {
      int64_t e = base + j * rd.inner;
      dot += LOG ? to_f32(dy[e]) : to_f32(dy[e]) * to_f32(y[e]);
    }
    for (int64_t j = 0; j < rd.n; ++j) {
      int64_t e = base + j * rd.inner;
      float yv = to_f32(y[e]), g = to_f32(dy[e]);
      dx[e] = from_f32<T>(LOG ? g - __expf(yv) * dot : yv * (g - dot));
    }
  }
}

// amax: thread per (outer, inner) column; first index of the maximum, NaN wins.
template <typename T>
__global__ void amax_kernel(T* __restrict__ out, int64_t* __restrict__ idx, const T* __restrict__ x, ReduceDim rd) {
  int64_t cols = rd.outer * rd.inner;
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < cols;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t base = (q / rd.inner) * rd.n * rd.inner + q % rd.inner;
    float best = to_f32(x[base]);
    int64_t bi = 0;
    for (int64_t j = 1; j < rd.n && !isnan(best); ++j) {
      float v = to_f32(x[base + j * rd.inner]);
      if (v > best || isnan(v)) {
        best = v;
        bi = j;
      }
    }
    out[q] = from_f32<T>(best);
    idx[q] = bi;
  }
}

template <typename T>
__global__ void amax_backward_kernel(T* __restrict__ dx, const T* __restrict__ dy, const int64_t* __restrict__ idx,
                                     ReduceDim rd) {
  int64_t cols = rd.outer * rd.inner;
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < cols;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t e = (q / rd.inner) * rd.n * rd.inner + idx[q] * rd.inner + q % rd.inner;
    dx[e] = from_f32<T>(to_f32(dx[e]) + to_f32(dy[q]));
  }
}

template <int MODE>
void softmax_like(const char* op, const Tensor& out, const Tensor& x, ReduceDim r) {
  cudaStream_t s = cuda::current_stream();
  if (r.inner == 1) {
    dispatch_rows(x.dtype(), op, r.n, {out.data_ptr(), x.data_ptr()}, [&](auto tag, auto v, auto ch, RowLaunch L) {
      using T = decltype(tag);
      constexpr int V = decltype(v)::value, CH = decltype(ch)::value;
      auto* k = softmax_row_kernel<T, V, CH, MODE>;
      k<<<resident_grid(k, L.threads, r.outer), L.threads, 0, s>>>(ptr<T>(out), ptr<const T>(x), r.outer, r.n);
    });
  } else {
    dispatch_cuda_float(x.dtype(), op, [&](auto tag) {
      using T = decltype(tag);
      softmax_col_kernel<T, MODE><<<grid_for(r.outer * r.inner, kBlock), kBlock, 0, s>>>(ptr<T>(out),
                                                                                       ptr<const T>(x), r);
    });
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

void softmax_cuda(const Tensor& out, const Tensor& x, ReduceDim r, bool log) {
  if (log)
    softmax_like<1>("log_softmax", out, x, r);
  else
    softmax_like<0>("softmax", out, x, r);
}

void logsumexp_cuda(const Tensor& out, const Tensor& x, ReduceDim r) { softmax_like<2>("logsumexp", out, x, r); }

void softmax_backward_cuda(const Tensor& dx, const Tensor& y, const Tensor& dy, ReduceDim r, bool log) {
  cudaStream_t s = cuda::current_stream();
  const char* op = log ? "log_softmax" : "softmax";
  KESTREL_CHECK(dy.is_contiguous() && y.is_contiguous() && dy.dtype() == y.dtype(), op,
                "backward expects contiguous y and dy of one dtype");
  if (r.inner == 1) {
    dispatch_rows(y.dtype(), op, r.n, {dx.data_ptr(), y.data_ptr(), dy.data_ptr()},
                  [&](auto tag, auto v, auto ch, RowLaunch L) {
                    using T = decltype(tag);
                    constexpr int V = decltype(v)::value, CH = decltype(ch)::value;
                    auto* k = log ? softmax_backward_row_kernel<T, V, CH, true> : softmax_backward_row_kernel<T, V, CH, false>;
                    k<<<resident_grid(k, L.threads, r.outer), L.threads, 0, s>>>(ptr<T>(dx), ptr<const T>(y),
                                                                                ptr<const T>(dy), r.outer, r.n);
                  });
  } else {
    dispatch_cuda_float(y.dtype(), op, [&](auto tag) {
      using T = decltype(tag);
      unsigned g = grid_for(r.outer * r.inner, kBlock);
      if (log)
        softmax_backward_col_kernel<T, true><<<g, kBlock, 0, s>>>(ptr<T>(dx), ptr<const T>(y), ptr<const T>(dy), r);
      else
        softmax_backward_col_kernel<T, false><<<g, kBlock, 0, s>>>(ptr<T>(dx), ptr<const T>(y), ptr<const T>(dy), r);
    });
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

void amax_cuda(const Tensor& out, const Tensor& idx, const Tensor& x, ReduceDim r) {
  dispatch_cuda_float(x.dtype(), "amax", [&](auto tag) {
    using T = decltype(tag);
    amax_kernel<T><<<grid_for(r.outer * r.inner, kBlock), kBlock, 0, cuda::current_stream()>>>(
        ptr<T>(out), ptr<int64_t>(idx), ptr<const T>(x), r);
  });
  KESTREL_CUDA_CHECK_LAUNCH();
}

void amax_backward_cuda(const Tensor& dx, const Tensor& dy, const Tensor& idx, ReduceDim r) {
  Tensor g = dy.contiguous();
  dispatch_cuda_float(dx.dtype(), "amax", [&](auto tag) {
    using T = decltype(tag);
    amax_backward_kernel<T><<<grid_for(r.outer * r.inner, kBlock), kBlock, 0, cuda::current_stream()>>>(
        ptr<T>(dx), ptr<const T>(g), ptr<const int64_t>(idx), r);
  });
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace

KESTREL_REGISTER_KERNEL(softmax_forward, cuda, softmax_cuda);
KESTREL_REGISTER_KERNEL(softmax_backward, cuda, softmax_backward_cuda);
KESTREL_REGISTER_KERNEL(logsumexp_forward, cuda, logsumexp_cuda);
KESTREL_REGISTER_KERNEL(amax_forward, cuda, amax_cuda);
KESTREL_REGISTER_KERNEL(amax_backward, cuda, amax_backward_cuda);

}  // namespace kestrel::cuda_ops
