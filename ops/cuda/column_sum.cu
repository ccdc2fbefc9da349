// Deterministic column reduction on the device (column_sum.h): [rows, C] -> [C], f32 accumulation.
//
// Pass 1: the grid is (column strips) x (row slabs). A 32 x 8 block owns a strip of 32 16-byte
// vectors (256 bf16 / 128 f32 columns) and a slab of rows; thread (tx, ty) sums rows ty, ty + 8, ...
// of its vector with 4 rows' loads in flight, then the 8 row lanes are combined through shared
// memory in a fixed order. Slabs are sized so that about 8 blocks per SM cover the device (enough
// loads in flight to run at copy bandwidth even for a single strip). Pass 2: 32 x 8 threads per 32
// columns add the slabs' f32 partials (workspace [slabs, C]): lane ty takes slabs ty, ty + 8, ... in
// order, then the 8 lanes combine in a fixed order (a one-thread-per-column pass 2 was latency bound:
// ~66 dependent loads). With one slab, pass 1 writes the output directly. A batched call reduces a
// few equally shaped inputs (the LayerNorm weight and bias gradients) in the same two launches.
// No atomics: the order of every addition is fixed by the shape.
#include <algorithm>

#include "cuda/column_sum.h"
#include "cuda/row_tile.cuh"
#include "kestrel/runtime/memory.h"

namespace kestrel::cuda_ops {
namespace {

constexpr int kLanesX = 32, kLanesY = 8, kUnroll = 4;

template <typename To>
__device__ __forceinline__ void store_one(To* p, float v) {
  *p = from_f32<To>(v);
}

// Up to kMaxBatch outputs of a batched call (blockIdx.z picks one).
template <typename To>
struct Outs {
  To* p[kMaxColumnSumBatch];
};

// partial [batch, gridDim.y, C] (f32) or, when partial is null, outs[b] [C] directly. Input b is
// x + b * xbs.
template <typename T, typename To, int V>
__global__ __launch_bounds__(kLanesX* kLanesY) void column_partial_kernel(Outs<To> outs, float* __restrict__ partial,
                                                                         const T* __restrict__ x, int64_t xbs,
                                                                         int64_t rows, int64_t C, int64_t ld,
                                                                         int64_t slab_rows) {
  __shared__ float sm[kLanesY][kLanesX * V + 1];
  To* __restrict__ out = outs.p[blockIdx.z];
  x += blockIdx.z * xbs;
  if (partial) partial += static_cast<int64_t>(blockIdx.z) * gridDim.y * C;
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * kLanesX + tx) * V;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * slab_rows;
  const int64_t r1 = std::min<int64_t>(rows, r0 + slab_rows);
  float acc[V];
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = 0.0f;
  if (c0 < C) {
    int64_t r = r0 + ty;
    for (; r + (kUnroll - 1) * kLanesY < r1; r += kUnroll * kLanesY) {
      Pack<T, V> v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = load_pack<T, V>(x + (r + u * kLanesY) * ld + c0);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] += to_f32(v[u].v[j]);
    }
    for (; r < r1; r += kLanesY) {
      Pack<T, V> v = load_pack<T, V>(x + r * ld + c0);
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] += to_f32(v.v[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < V; ++j) sm[ty][tx * V + j] = acc[j];
  __syncthreads();
  // Fixed-order combine of the 8 row lanes: the block's threads share the strip's columns.
  for (int k = ty * kLanesX + tx; k < kLanesX * V; k += kLanesX * kLanesY) {
    int64_t c = static_cast<int64_t>(blockIdx.x) * kLanesX * V + k;
    if (c >= C) continue;
    float s = sm[0][k];
#pragma unroll
    for (int y = 1; y < kLanesY; ++y) s += sm[y][k];
    if (partial)
      partial[static_cast<int64_t>(blockIdx.y) * C + c] = s;
    else
      store_one(out + c, s);
  }
}

// Pass 2, wide: a 32 x 8 block per 32 columns; row lane ty adds slabs ty, ty + 8, ... (coalesced
// 128-byte rows, about slabs / 8 loads in flight per thread), then the 8 lanes combine in a fixed order.
template <typename To>
__global__ __launch_bounds__(kLanesX* kLanesY) void column_final_wide_kernel(Outs<To> outs,
                                                                            const float* __restrict__ partial,
                                                                            int slabs, int64_t C) {
  __shared__ float sm[kLanesY][kLanesX + 1];
  To* __restrict__ out = outs.p[blockIdx.y];
  partial += static_cast<int64_t>(blockIdx.y) * slabs * C;
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kLanesX + tx;
  float acc = 0.0f;
  if (c < C) {
    int k = ty;
    for (; k + 3 * kLanesY < slabs; k += 4 * kLanesY) {
      float v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = partial[static_cast<int64_t>(k + u * kLanesY) * C + c];
#pragma unroll
      for (int u = 0; u < 4; ++u) acc += v[u];
    }
    for (; k < slabs; k += kLanesY) acc += partial[static_cast<int64_t>(k) * C + c];
  }
  sm[ty][tx] = acc;
  __syncthreads();
  if (ty == 0 && c < C) {
    float s = sm[0][tx];
#pragma unroll
    for (int y = 1; y < kLanesY; ++y) s += sm[y][tx];
    store_one(out + c, s);
  }
}

template <typename To>
__global__ void zero_kernel(To* out, int64_t C) {
  int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c < C) out[c] = from_f32<To>(0.0f);
}

template <typename F>
void dispatch_any(DType t, const char* op, F&& f) {
  dispatch_cuda_float(t, op, std::forward<F>(f));
}

}  // namespace

void column_sum(void* out, DType out_dtype, const void* x, DType x_dtype, int64_t rows, int64_t C, int64_t ld,
                Device device, cudaStream_t stream) {
  void* outs[1] = {out};
  column_sum_batched(outs, 1, out_dtype, x, 0, x_dtype, rows, C, ld, device, stream);
}

void column_sum_batched(void* const* outs, int count, DType out_dtype, const void* x, int64_t x_batch_stride,
                        DType x_dtype, int64_t rows, int64_t C, int64_t ld, Device device, cudaStream_t stream) {
  KESTREL_CHECK(C >= 0 && rows >= 0 && ld >= C, "column_sum", "invalid shape rows ", rows, ", C ", C, ", ld ", ld);
  KESTREL_CHECK(count >= 1 && count <= kMaxColumnSumBatch, "column_sum", "batch of ", count, " (at most ",
                kMaxColumnSumBatch, ")");
  if (C == 0) return;
  dispatch_any(out_dtype, "column_sum", [&](auto otag) {
    using To = decltype(otag);
    Outs<To> o{};
    for (int b = 0; b < count; ++b) o.p[b] = static_cast<To*>(outs[b]);
    if (rows == 0) {
      for (int b = 0; b < count; ++b) {
        zero_kernel<To><<<static_cast<unsigned>(ceil_div(C, 256)), 256, 0, stream>>>(o.p[b], C);
        KESTREL_CUDA_CHECK_LAUNCH();
      }
      return;
    }
    dispatch_any(x_dtype, "column_sum", [&](auto xtag) {
      using T = decltype(xtag);
      constexpr int N = Vec<T>::N;
      const T* xp = static_cast<const T*>(x);
      auto launch = [&](auto vtag) {
        constexpr int V = decltype(vtag)::value;
        int64_t strips = ceil_div(C, static_cast<int64_t>(kLanesX) * V);
        int64_t target = static_cast<int64_t>(sm_count()) * 8 / count;  // 8 blocks of 256 threads per SM
        int64_t max_slabs = std::max<int64_t>(1, rows / (kLanesY * kUnroll));
        int64_t slabs = std::clamp<int64_t>(ceil_div(target, strips), 1, std::min<int64_t>(max_slabs, 65535));
        int64_t slab_rows = ceil_div(rows, slabs);
        slabs = ceil_div(rows, slab_rows);
        Tensor partial;
        if (slabs > 1) {
          TagScope ws(MemoryTag::Workspace);
          partial = Tensor::empty({count, slabs, C}, DType::F32, device);  // [count, slabs, C]
        }
        float* pp = slabs > 1 ? static_cast<float*>(partial.data_ptr()) : nullptr;
        dim3 grid(static_cast<unsigned>(strips), static_cast<unsigned>(slabs), static_cast<unsigned>(count));
        column_partial_kernel<T, To, V>
            <<<grid, dim3(kLanesX, kLanesY), 0, stream>>>(o, pp, xp, x_batch_stride, rows, C, ld, slab_rows);
        KESTREL_CUDA_CHECK_LAUNCH();
        if (slabs > 1) {
          column_final_wide_kernel<To>
              <<<dim3(static_cast<unsigned>(ceil_div(C, kLanesX)), static_cast<unsigned>(count)), dim3(kLanesX, kLanesY),
                 0, stream>>>(o, pp, static_cast<int>(slabs), C);
          KESTREL_CUDA_CHECK_LAUNCH();
        }
      };
      bool vec = C % N == 0 && ld % N == 0 && aligned16(xp);
      if (count > 1) vec = vec && x_batch_stride % N == 0;
      if (vec)
        launch(std::integral_constant<int, N>{});
      else
        launch(std::integral_constant<int, 1>{});
    });
  });
}

}  // namespace kestrel::cuda_ops
