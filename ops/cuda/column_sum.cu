// Deterministic column reduction on the device (column_sum.h): [rows, C] -> [C], f32 accumulation.
//
// Pass 1: the grid is (column strips) x (row slabs). A 32 x 8 block owns a strip of 32 16-byte
// vectors (256 bf16 / 128 f32 columns) and a slab of rows; thread (tx, ty) sums rows ty, ty + 8, ...
// of its vector with 4 rows' loads in flight, then the 8 row lanes are combined through shared
// memory in a fixed order. Slabs are sized so that about 8 blocks per SM cover the device (enough
// loads in flight to run at copy bandwidth even for a single strip). Pass 2: one thread per column
// adds the slabs' f32 partials (workspace [slabs, C]) in slab order. With one slab, pass 1 writes
// the output directly. No atomics: the order of every addition is fixed by the shape.
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

// partial [gridDim.y, C] (f32) or, when partial is null, out [C] directly.
template <typename T, typename To, int V>
__global__ __launch_bounds__(kLanesX* kLanesY) void column_partial_kernel(To* __restrict__ out,
                                                                         float* __restrict__ partial,
                                                                         const T* __restrict__ x, int64_t rows,
                                                                         int64_t C, int64_t ld, int64_t slab_rows) {
  __shared__ float sm[kLanesY][kLanesX * V + 1];
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

template <typename To>
__global__ void column_final_kernel(To* __restrict__ out, const float* __restrict__ partial, int slabs, int64_t C) {
  int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  float s = 0.0f;
  for (int k = 0; k < slabs; ++k) s += partial[static_cast<int64_t>(k) * C + c];
  store_one(out + c, s);
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
  KESTREL_CHECK(C >= 0 && rows >= 0 && ld >= C, "column_sum", "invalid shape rows ", rows, ", C ", C, ", ld ", ld);
  if (C == 0) return;
  dispatch_any(out_dtype, "column_sum", [&](auto otag) {
    using To = decltype(otag);
    To* o = static_cast<To*>(out);
    if (rows == 0) {
      zero_kernel<To><<<static_cast<unsigned>(ceil_div(C, 256)), 256, 0, stream>>>(o, C);
      KESTREL_CUDA_CHECK_LAUNCH();
      return;
    }
    dispatch_any(x_dtype, "column_sum", [&](auto xtag) {
      using T = decltype(xtag);
      constexpr int N = Vec<T>::N;
      const T* xp = static_cast<const T*>(x);
      auto launch = [&](auto vtag) {
        constexpr int V = decltype(vtag)::value;
        int64_t strips = ceil_div(C, static_cast<int64_t>(kLanesX) * V);
        int64_t target = static_cast<int64_t>(sm_count()) * 8;  // 8 blocks of 256 threads per SM
        int64_t max_slabs = std::max<int64_t>(1, rows / (kLanesY * kUnroll));
        int64_t slabs = std::clamp<int64_t>(ceil_div(target, strips), 1, std::min<int64_t>(max_slabs, 65535));
        int64_t slab_rows = ceil_div(rows, slabs);
        slabs = ceil_div(rows, slab_rows);
        Tensor partial;
        if (slabs > 1) {
          TagScope ws(MemoryTag::Workspace);
          partial = Tensor::empty({slabs, C}, DType::F32, device);  // [slabs, C]
        }
        float* pp = slabs > 1 ? static_cast<float*>(partial.data_ptr()) : nullptr;
        dim3 grid(static_cast<unsigned>(strips), static_cast<unsigned>(slabs));
        column_partial_kernel<T, To, V>
            <<<grid, dim3(kLanesX, kLanesY), 0, stream>>>(o, pp, xp, rows, C, ld, slab_rows);
        KESTREL_CUDA_CHECK_LAUNCH();
        if (slabs > 1) {
          column_final_kernel<To><<<static_cast<unsigned>(ceil_div(C, 256)), 256, 0, stream>>>(
              o, pp, static_cast<int>(slabs), C);
          KESTREL_CUDA_CHECK_LAUNCH();
        }
      };
      if (C % N == 0 && ld % N == 0 && aligned16(xp))
        launch(std::integral_constant<int, N>{});
      else
        launch(std::integral_constant<int, 1>{});
    });
  });
}

}  // namespace kestrel::cuda_ops
