// CUDA rotary position embedding (rotate-half form) for the slot in kernels/rope.h.
//
// The op's frequency table (inv_freq per frequency, attention scaling) travels as a kernel parameter
// (at most kRopeMaxFrequencies doubles, 2 KiB) and each block copies it to shared memory first, so the
// threads of a warp, which read different frequencies, never serialise on the constant cache.
// One thread per (token, frequency i < rotary_dim/2): it computes the angle once (position * inv_freq
// in f64, reduced mod 2 pi, then sincosf: accurate for positions in the millions, where an f32
// angle would lose 3 digits) and rotates the pair (i, i + half) of every head of that token.
// Consecutive threads take consecutive i, so each head's row is read and written coalesced.
// Dimensions past rotary_dim are copied by the threads of the pass-through range.
#include "cuda/common.cuh"
#include "kernels/rope.h"

namespace kestrel::cuda_ops {
namespace {

struct RopeTable {
  double inv_freq[kRopeMaxFrequencies];
};

template <typename T, typename P>
__global__ void rope_kernel(T* __restrict__ out, const T* __restrict__ x, const P* __restrict__ pos, int64_t tokens,
                            int64_t H, int64_t D, int64_t half, int64_t rd, const RopeTable table, float scale,
                            bool inverse) {
  __shared__ double inv_freq[kRopeMaxFrequencies];
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) inv_freq[i] = table.inv_freq[i];
  __syncthreads();
  int64_t per_token = half + (D - rd);
  int64_t total = tokens * per_token;
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < total;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t t = q / per_token, i = q % per_token;
    const T* xt = x + t * H * D;
    T* ot = out + t * H * D;
    if (i >= half) {  // pass-through dims
      int64_t d = rd + (i - half);
      for (int64_t h = 0; h < H; ++h) ot[h * D + d] = xt[h * D + d];
      continue;
    }
    double a = static_cast<double>(pos[t]) * inv_freq[i];
    a -= 6.283185307179586 * floor(a / 6.283185307179586);
    float sn, cs;
    sincosf(static_cast<float>(a), &sn, &cs);
    sn *= inverse ? -scale : scale;
    cs *= scale;
    for (int64_t h = 0; h < H; ++h) {
      float x1 = to_f32(xt[h * D + i]), x2 = to_f32(xt[h * D + i + half]);
      ot[h * D + i] = from_f32<T>(x1 * cs - x2 * sn);
      ot[h * D + i + half] = from_f32<T>(x2 * cs + x1 * sn);
    }
  }
}

void rope_cuda(const Tensor& out, const Tensor& x, const Tensor& positions, const RopeFrequencies& freqs,
               bool inverse) {
  const int64_t T = x.shape()[0], H = x.shape()[1], D = x.shape()[2];
  const int64_t rotary_dim = freqs.rotary_dim(), half = rotary_dim / 2;
  KESTREL_CHECK(positions.dtype() == DType::I32 || positions.dtype() == DType::I64, "rope",
                "positions must be i32 or i64, got ", dtype_name(positions.dtype()));
  KESTREL_CHECK(half <= kRopeMaxFrequencies, "rope", "the CUDA kernel takes at most ", kRopeMaxFrequencies,
                " frequencies (rotary_dim ", 2 * kRopeMaxFrequencies, "), got rotary_dim ", rotary_dim);
  int64_t total = T * (half + D - rotary_dim);
  if (total == 0) return;
  RopeTable table{};
  for (int64_t i = 0; i < half; ++i) table.inv_freq[i] = freqs.inv_freq[i];
  const float scale = static_cast<float>(freqs.attention_scaling);
  cudaStream_t s = cuda::current_stream();
  dispatch_cuda_float(x.dtype(), "rope", [&](auto tag) {
    using Tp = decltype(tag);
    unsigned g = grid_for(total, 256);
    if (positions.dtype() == DType::I32)
      rope_kernel<Tp, int32_t><<<g, 256, 0, s>>>(ptr<Tp>(out), ptr<const Tp>(x), ptr<const int32_t>(positions), T, H,
                                                 D, half, rotary_dim, table, scale, inverse);
    else
      rope_kernel<Tp, int64_t><<<g, 256, 0, s>>>(ptr<Tp>(out), ptr<const Tp>(x), ptr<const int64_t>(positions), T, H,
                                                 D, half, rotary_dim, table, scale, inverse);
  });
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace

KESTREL_REGISTER_KERNEL(rope, cuda, rope_cuda);

}  // namespace kestrel::cuda_ops
