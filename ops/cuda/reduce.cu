// CUDA sum over the dims where `out` (keepdim form, contiguous) has size 1: the slot in
// kernels/reduce.h. f32 accumulation, deterministic (no atomics).
//
// Two shapes of work, chosen by whether x's unit-stride dim is reduced:
// - inner reduction (e.g. sum over the last dim): one block per output, the block strides over the
//   reduced elements (coalesced when the innermost reduced dim is unit-stride) and tree-reduces;
// - column reduction (e.g. a bias gradient [rows, N] -> [N], x's kept dims one unit-stride run after
//   coalescing and the reduced dims one strided run): the slab x strip kernel of column_sum.h;
// - other outer reductions: a 32 x 16 block covers 32 adjacent outputs (coalesced across
//   threadIdx.x) and splits the reduction over 16 rows of threads, then combines the 16 partials in
//   shared memory in a fixed order.
#include "cuda/column_sum.h"
#include "cuda/common.cuh"
#include "kernels/reduce.h"

namespace kestrel::cuda_ops {
namespace {

// Kept dims (output order) and reduced dims of x, as two indexers over x's strides.
struct SumPlan {
  Indexer<1> kept, red;
  int64_t nout, nred;
};

template <typename T>
__global__ void sum_inner_kernel(T* __restrict__ out, const T* __restrict__ x, SumPlan p) {
  __shared__ float scratch[32];
  for (int64_t o = blockIdx.x; o < p.nout; o += gridDim.x) {
    int64_t base[1];
    p.kept.offsets(o, base);
    float acc = 0.0f;
    if (p.red.rank == 1) {
      int64_t st = p.red.strides[0][0];
      for (int64_t r = threadIdx.x; r < p.nred; r += blockDim.x) acc += to_f32(x[base[0] + r * st]);
    } else {
      for (int64_t r = threadIdx.x; r < p.nred; r += blockDim.x) {
        int64_t off[1];
        p.red.offsets(r, off);
        acc += to_f32(x[base[0] + off[0]]);
      }
    }
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) out[o] = from_f32<T>(acc);
  }
}

constexpr int kOuterX = 32, kOuterY = 16;

template <typename T>
__global__ void sum_outer_kernel(T* __restrict__ out, const T* __restrict__ x, SumPlan p) {
  __shared__ float partial[kOuterY][kOuterX];
  int64_t o = blockIdx.x * static_cast<int64_t>(kOuterX) + threadIdx.x;
  float acc = 0.0f;
  if (o < p.nout) {
    int64_t base[1];
    p.kept.offsets(o, base);
    for (int64_t r = threadIdx.y; r < p.nred; r += kOuterY) {
      int64_t off[1];
      p.red.offsets(r, off);
      acc += to_f32(x[base[0] + off[0]]);
    }
  }
  partial[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && o < p.nout) {
    float s = 0.0f;
#pragma unroll
    for (int y = 0; y < kOuterY; ++y) s += partial[y][threadIdx.x];
    out[o] = from_f32<T>(s);
  }
}

void sum_cuda(const Tensor& out, const Tensor& x) {
  check_cuda_dtype(x.dtype(), "sum");
  KESTREL_CHECK(out.dtype() == x.dtype(), "sum", "output dtype differs from input");
  Shape kept_shape, red_shape;
  Strides kept_stride, red_stride;
  bool inner = false;
  for (int64_t d = 0; d < x.dim(); ++d) {
    bool reduced = out.shape()[d] == 1 && x.shape()[d] != 1;
    if (reduced) {
      red_shape.push_back(x.shape()[d]);
      red_stride.push_back(x.strides()[d]);
      if (x.strides()[d] == 1) inner = true;
    } else {
      kept_shape.push_back(x.shape()[d]);
      kept_stride.push_back(x.strides()[d]);
    }
  }
  auto indexer = [](const Shape& shape, const Strides& strides) { return make_indexer<1>(shape, {&strides}, "sum"); };
  SumPlan p{indexer(kept_shape, kept_stride), indexer(red_shape, red_stride), numel(kept_shape), numel(red_shape)};
  cudaStream_t s = cuda::current_stream();
  if (!inner && p.kept.rank == 1 && p.kept.strides[0][0] == 1 && p.red.rank == 1 && p.red.strides[0][0] >= p.nout) {
    column_sum(out.data_ptr(), out.dtype(), x.data_ptr(), x.dtype(), p.nred, p.nout, p.red.strides[0][0], x.device(), s);
    return;
  }
  dispatch_cuda_float(x.dtype(), "sum", [&](auto tag) {
    using T = decltype(tag);
    if (inner || p.nout < 4096) {
      int block = p.nred >= 1024 ? 512 : (p.nred >= 256 ? 256 : 64);
      unsigned grid = static_cast<unsigned>(std::min<int64_t>(p.nout, 65535 * 4));
      sum_inner_kernel<T><<<grid, block, 0, s>>>(ptr<T>(out), ptr<const T>(x), p);
    } else {
      dim3 block(kOuterX, kOuterY);
      sum_outer_kernel<T><<<static_cast<unsigned>(ceil_div(p.nout, kOuterX)), block, 0, s>>>(ptr<T>(out),
                                                                                          ptr<const T>(x), p);
    }
  });
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace

KESTREL_REGISTER_KERNEL(sum, cuda, sum_cuda);

}  // namespace kestrel::cuda_ops
