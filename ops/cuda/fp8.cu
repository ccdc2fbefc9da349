// CUDA FP8 casts and delayed-scaling kernels (kernels/fp8.h); the GEMM is in fp8_gemm.cu.
//
// The cast reads x once and writes its fp8 codes plain [R, C] and/or transposed [C, R] (cuBLASLt's FP8
// GEMMs take K-contiguous operands only, so backward needs transposed copies). A block converts a
// 64 x 64 tile: 16-byte loads of x, 8 codes per thread written as one 8-byte store, the transposed copy
// through shared memory, again 8 codes (8 consecutive rows) per store. Rounding is cuda_fp8.h's
// saturating conversion of x * scale (__fmul_rn: no contraction), which cpu/fp8.cpp models exactly.
// The amax folds |x|'s bits into the scalar with atomicMax (non-negative floats order as their bits;
// a NaN wins, as on the CPU). Shapes or pointers the vector path cannot take (R or C not a multiple
// of 8, unaligned) go through a one-element-per-thread kernel.
#include <cuda_fp8.h>

#include <cfloat>

#include "cuda/common.cuh"
#include "kernels/fp8.h"

namespace kestrel::cuda_ops {
namespace {

constexpr int kTile = 64;
constexpr int kCastThreads = 256;

__device__ __forceinline__ uint8_t to_fp8(float v, float s, __nv_fp8_interpretation_t fmt) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fmul_rn(v, s), __NV_SATFINITE, fmt));
}

__device__ __forceinline__ uint32_t abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

__device__ __forceinline__ void fold_amax(unsigned* amax, uint32_t m) {
  m = __reduce_max_sync(0xffffffffu, m);
  if ((threadIdx.x & 31) == 0 && m != 0) atomicMax(amax, m);
}

__device__ __forceinline__ void write_scales(float* scales_out, float s) {
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
    scales_out[0] = __fdiv_rn(1.0f, s);
    scales_out[1] = s;
  }
}

__device__ __forceinline__ uint2 pack8(const uint8_t (&q)[8]) {
  uint2 p;
  p.x = q[0] | (q[1] << 8) | (q[2] << 16) | (static_cast<uint32_t>(q[3]) << 24);
  p.y = q[4] | (q[5] << 8) | (q[6] << 16) | (static_cast<uint32_t>(q[7]) << 24);
  return p;
}

template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&f)[8]) {
  if constexpr (sizeof(T) == 2) {
    Vec<T> v = load_vec(p);
#pragma unroll
    for (int j = 0; j < 8; ++j) f[j] = to_f32(v.v[j]);
  } else {
    Vec<T> a = load_vec(p), b = load_vec(p + 4);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      f[j] = to_f32(a.v[j]);
      f[j + 4] = to_f32(b.v[j]);
    }
  }
}

// R % 8 == 0, C % 8 == 0, x 16-byte aligned, outputs 8-byte aligned. grid (ceil(C/64), ceil(R/64)).
template <typename T, bool kPlain, bool kTrans>
__global__ void __launch_bounds__(kCastThreads) cast_tile_kernel(const T* __restrict__ x, uint8_t* __restrict__ out,
                                                                 uint8_t* __restrict__ out_t, const float* scale,
                                                                 float* scales_out, unsigned* amax, int64_t R,
                                                                 int64_t C, __nv_fp8_interpretation_t fmt) {
  __shared__ __align__(8) uint8_t tile[kTile][kTile + 8];
  const float s = *scale;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile, c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  uint32_t m = 0;
  for (int i = threadIdx.x; i < kTile * kTile / 8; i += kCastThreads) {
    const int tr = i / 8, tc = (i % 8) * 8;
    const int64_t r = r0 + tr, c = c0 + tc;
    if (r < R && c < C) {
      float f[8];
      load8(x + r * C + c, f);
      uint8_t q[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        m = max(m, abs_bits(f[j]));
        q[j] = to_fp8(f[j], s, fmt);
      }
      const uint2 p = pack8(q);
      if constexpr (kPlain) *reinterpret_cast<uint2*>(out + r * C + c) = p;
      if constexpr (kTrans) *reinterpret_cast<uint2*>(&tile[tr][tc]) = p;
    }
  }
  if constexpr (kTrans) {
    __syncthreads();
    for (int i = threadIdx.x; i < kTile * kTile / 8; i += kCastThreads) {
      const int tc = i / 8, tr = (i % 8) * 8;
      const int64_t c = c0 + tc, r = r0 + tr;
      if (c < C && r < R) {
        uint8_t q[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) q[j] = tile[tr + j][tc];
        *reinterpret_cast<uint2*>(out_t + c * R + r) = pack8(q);
      }
    }
  }
  if (amax) fold_amax(amax, m);
  write_scales(scales_out, s);
}

// Any shape: one element per thread (grid-stride). out / out_t may be null.
template <typename T>
__global__ void cast_scalar_kernel(const T* __restrict__ x, uint8_t* out, uint8_t* out_t, const float* scale,
                                   float* scales_out, unsigned* amax, int64_t R, int64_t C,
                                   __nv_fp8_interpretation_t fmt) {
  const float s = *scale;
  uint32_t m = 0;
  const int64_t n = R * C;
  // Every thread runs the same number of iterations so the warp reduction below sees all lanes.
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t base = 0; base < n; base += stride) {
    const int64_t i = base + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) {
      const float v = to_f32(x[i]);
      m = max(m, abs_bits(v));
      const uint8_t q = to_fp8(v, s, fmt);
      if (out) out[i] = q;
      if (out_t) out_t[(i % C) * R + i / C] = q;
    }
  }
  if (amax) fold_amax(amax, m);
  write_scales(scales_out, s);
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

__nv_fp8_interpretation_t interpretation(Fp8Format f) { return f == Fp8Format::E4M3 ? __NV_E4M3 : __NV_E5M2; }

template <typename T, bool kPlain, bool kTrans>
void launch_tile(const Tensor& x, const Tensor& out, const Tensor& out_t, const float* scale, float* scales_out,
                 unsigned* amax, __nv_fp8_interpretation_t fmt) {
  const int64_t R = x.shape()[0], C = x.shape()[1];
  dim3 grid(static_cast<unsigned>(ceil_div(C, kTile)), static_cast<unsigned>(ceil_div(R, kTile)));
  cast_tile_kernel<T, kPlain, kTrans><<<grid, kCastThreads, 0, cuda::current_stream()>>>(
      ptr<const T>(x), kPlain ? ptr<uint8_t>(out) : nullptr, kTrans ? ptr<uint8_t>(out_t) : nullptr, scale,
      scales_out, amax, R, C, fmt);
}

void cast_cuda(const Tensor& x, const Tensor& out, const Tensor& out_t, const Tensor& scale, const Tensor& scales_out,
               const Tensor& amax, Fp8Format format) {
  const int64_t R = x.shape()[0], C = x.shape()[1];
  const float* sp = ptr<const float>(scale);
  float* so = ptr<float>(scales_out);
  unsigned* ap = amax.defined() ? static_cast<unsigned*>(amax.data_ptr()) : nullptr;
  const __nv_fp8_interpretation_t fmt = interpretation(format);
  const bool plain = out.defined(), trans = out_t.defined();
  const bool aligned = (reinterpret_cast<uintptr_t>(x.data_ptr()) & 15u) == 0 &&
                       (!plain || (reinterpret_cast<uintptr_t>(out.data_ptr()) & 7u) == 0) &&
                       (!trans || (reinterpret_cast<uintptr_t>(out_t.data_ptr()) & 7u) == 0);
  const bool vector = R % 8 == 0 && C % 8 == 0 && aligned && R > 0 && C > 0;
  dispatch_cuda_float(x.dtype(), "fp8_cast", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, f16_t>) {
      throw make_error("fp8_cast", "f16 input is not supported (f32 or bf16)");
    } else if (vector) {
      if (plain && trans) launch_tile<T, true, true>(x, out, out_t, sp, so, ap, fmt);
      else if (plain) launch_tile<T, true, false>(x, out, out_t, sp, so, ap, fmt);
      else if (trans) launch_tile<T, false, true>(x, out, out_t, sp, so, ap, fmt);
      else launch_tile<T, false, false>(x, out, out_t, sp, so, ap, fmt);
    } else {
      cast_scalar_kernel<T><<<grid_for(std::max<int64_t>(R * C, 1), 256), 256, 0, cuda::current_stream()>>>(
          ptr<const T>(x), plain ? ptr<uint8_t>(out) : nullptr, trans ? ptr<uint8_t>(out_t) : nullptr, sp, so, ap, R,
          C, fmt);
    }
  });
  KESTREL_CUDA_CHECK_LAUNCH();
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
