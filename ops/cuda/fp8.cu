// CUDA FP8 casts and delayed-scaling kernels (kernels/fp8.h); the GEMM is in fp8_gemm.cu.
//
// The cast reads x once and writes its fp8 codes plain [Rp, C] and/or transposed [C, Rp] (cuBLASLt's
// FP8 GEMMs take K-contiguous operands only, so backward needs transposed copies), the rows past x's
// R being the zero padding of a GEMM operand: fp8_codes.cuh's 128 x 128 tile kernel with x as its
// source. Shapes or pointers the tile kernel cannot take (C or Rp not a multiple of 8, unaligned)
// go through a one-element-per-thread kernel. The same tile kernel writes SwiGLU's cast
// (fp8_producers.cu).
#include <cfloat>

#include "cuda/fp8_codes.cuh"
#include "kernels/fp8.h"

namespace kestrel::cuda_ops {
namespace {

using fp8::abs_bits;
using fp8::CastArgs;
using fp8::fold_amax;

// x [R, C] row-major as the tile kernel's source.
template <typename T>
struct CastSource {
  static constexpr int N = Vec<T>::N;  // elements per 16-byte load: 8 (bf16) or 4 (f32)
  static constexpr int kBatch = 8;
  struct Raw {
    Vec<T> v[8 / N];
  };
  const T* __restrict__ x;
  int64_t C;
  __device__ __forceinline__ Raw fetch(int64_t r, int64_t c) const {
    Raw w;
#pragma unroll
    for (int i = 0; i < 8 / N; ++i) w.v[i] = load_vec(x + r * C + c + i * N);
    return w;
  }
  __device__ __forceinline__ void finish(const Raw& w, int64_t, int64_t, float (&v)[8]) const {
#pragma unroll
    for (int i = 0; i < 8 / N; ++i)
#pragma unroll
      for (int j = 0; j < N; ++j) v[i * N + j] = to_f32(w.v[i].v[j]);
  }
};

// Any shape: one element of [Rp, C] per thread (grid-stride). a.out / a.out_t may be null.
template <typename T>
__global__ void cast_scalar_kernel(const T* __restrict__ x, CastArgs a, int64_t R, int64_t C) {
  const float s = *a.scale;
  uint32_t m = 0;
  const int64_t n = a.Rp * C;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t r = i / C, c = i % C;
    uint8_t q = 0;  // a padding row
    if (r < R) {
      const float v = to_f32(x[i]);
      m = max(m, abs_bits(v));
      q = fp8::to_fp8(v, s, a.fmt);
    }
    if (a.out) a.out[i] = q;
    if (a.out_t) a.out_t[c * a.Rp + r] = q;
  }
  if (a.amax) fold_amax(a.amax, m);
  fp8::write_scales(a.scales_out, s);
}

template <typename T>
__global__ void amax_kernel(const T* __restrict__ x, int64_t n, unsigned* amax) {
  uint32_t m = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    m = max(m, abs_bits(to_f32(x[i])));
  fold_amax(amax, m);
}

__global__ void scale_kernel(const float* history, float* scale, int64_t R, int64_t H, float fmax, float pow2_margin) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= R) return;
  float m = 0.0f;
  bool finite = true;
  for (int64_t j = 0; j < H; ++j) {
    const float v = history[r * H + j];
    finite = finite && isfinite(v);
    m = fmaxf(m, v);
  }
  if (!finite || !(m > 0.0f)) return;
  const float v = __fdiv_rn(fmax, __fmul_rn(m, pow2_margin));
  if (v > 0.0f) scale[r] = isinf(v) ? FLT_MAX : v;
}

__global__ void roll_kernel(float* history, float* amax, int64_t R, int64_t H) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= R) return;
  for (int64_t j = H - 1; j > 0; --j) history[r * H + j] = history[r * H + j - 1];
  const float a = amax[r];
  history[r * H] = isfinite(a) ? a : 0.0f;
  amax[r] = 0.0f;
}

void cast_cuda(const Tensor& x, const kernels::Fp8CastTarget& into) {
  const int64_t R = x.shape()[0], C = x.shape()[1];
  const CastArgs a = fp8::cast_args(into, into.padded_rows() > 0 ? into.padded_rows() : R);
  const bool tile = fp8::tile_path_fits(a, C) && aligned16(x.data_ptr());
  dispatch_cuda_float(x.dtype(), "fp8_cast", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, f16_t>) {
      throw make_error("fp8_cast", "f16 input is not supported (f32 or bf16)");
    } else if (tile) {
      fp8::launch_cast_tile(CastSource<T>{ptr<const T>(x), C}, a, R, C);
    } else {
      cast_scalar_kernel<T><<<grid_for(std::max<int64_t>(a.Rp * C, 1), 256), 256, 0, cuda::current_stream()>>>(
          ptr<const T>(x), a, R, C);
      KESTREL_CUDA_CHECK_LAUNCH();
    }
  });
}

void amax_cuda(const Tensor& x, const Tensor& amax) {
  const int64_t n = x.numel();
  if (n == 0) return;
  dispatch_cuda_float(x.dtype(), "fp8_amax", [&](auto tag) {
    using T = decltype(tag);
    amax_kernel<T><<<grid_for(n, 256), 256, 0, cuda::current_stream()>>>(ptr<const T>(x), n,
                                                                         static_cast<unsigned*>(amax.data_ptr()));
  });
  KESTREL_CUDA_CHECK_LAUNCH();
}

void scale_cuda(const Tensor& history, const Tensor& scale, double fmax, int64_t margin) {
  const int64_t R = history.shape()[0], H = history.shape()[1];
  if (R == 0) return;
  scale_kernel<<<static_cast<unsigned>(ceil_div(R, 128)), 128, 0, cuda::current_stream()>>>(
      ptr<const float>(history), ptr<float>(scale), R, H, static_cast<float>(fmax),
      std::ldexp(1.0f, static_cast<int>(margin)));
  KESTREL_CUDA_CHECK_LAUNCH();
}

void roll_cuda(const Tensor& history, const Tensor& amax) {
  const int64_t R = history.shape()[0], H = history.shape()[1];
  if (R == 0) return;
  roll_kernel<<<static_cast<unsigned>(ceil_div(R, 128)), 128, 0, cuda::current_stream()>>>(ptr<float>(history),
                                                                                          ptr<float>(amax), R, H);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace

KESTREL_REGISTER_KERNEL(fp8_cast, cuda, cast_cuda);
KESTREL_REGISTER_KERNEL(fp8_amax, cuda, amax_cuda);
KESTREL_REGISTER_KERNEL(fp8_scale, cuda, scale_cuda);
KESTREL_REGISTER_KERNEL(fp8_roll, cuda, roll_cuda);

}  // namespace kestrel::cuda_ops
