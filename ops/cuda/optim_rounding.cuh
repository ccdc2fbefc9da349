// Private: what the AdamW kernels on CUDA share (optim.cu, optim_q8.cu): the per-step constants, the
// multi-tensor block lookup, and the 16-bit rounding of their outputs (the device twin of
// cpu/optim.cpp's round_stochastic / write_copy).
#pragma once

#include <cmath>

#include "cuda/common.cuh"
#include "kernels/optim.h"
#include "kestrel/runtime/philox.h"

namespace kestrel::cuda_ops {

// AdamW's per-step constants in f32, formed on the host as cpu/optim.cpp forms them.
struct AdamWConst {
  float decay, b1, b2, one_minus_b1, one_minus_b2, step_size, bc2_sqrt, eps;
};

inline AdamWConst adamw_constants(const kernels::AdamWHyper& h) {
  const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
  const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  AdamWConst c;
  c.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  c.b1 = static_cast<float>(h.beta1);
  c.b2 = static_cast<float>(h.beta2);
  c.one_minus_b1 = 1.0f - c.b1;  // float arithmetic, as the CPU's (1 - b1) with C = float
  c.one_minus_b2 = 1.0f - c.b2;
  c.step_size = static_cast<float>(h.lr / bc1);
  c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  c.eps = static_cast<float>(h.eps);
  return c;
}

// The tensor of a multi-tensor launch that this block works on (`start`: each tensor's first block).
__device__ __forceinline__ int find_tensor(const int* start, int count) {
  int t = 0;
  while (t + 1 < count && static_cast<int>(blockIdx.x) >= start[t + 1]) ++t;
  return t;
}

// round_stochastic of cpu/optim.cpp; T16 = bf16 (IS_BF16) or f16, returns the bits.
template <bool IS_BF16>
__device__ __forceinline__ uint16_t round_stochastic(float x, float u) {
  auto to_bits = [](float f) -> uint16_t {
    return IS_BF16 ? __bfloat16_as_ushort(__float2bfloat16_rn(f)) : __half_as_ushort(__float2half_rn(f));
  };
  auto from_bits = [](uint16_t b) -> float {
    return IS_BF16 ? __bfloat162float(__ushort_as_bfloat16(b)) : __half2float(__ushort_as_half(b));
  };
  uint16_t nearest = to_bits(x);
  if (!isfinite(x)) return nearest;
  float a = fabsf(x);
  uint16_t sign = signbit(x) ? 0x8000u : 0u;
  uint16_t hb = to_bits(a);
  float h = from_bits(hb);
  if (h == a) return nearest;
  uint16_t lo_b = h < a ? hb : static_cast<uint16_t>(hb - 1);
  uint16_t hi_b = static_cast<uint16_t>(lo_b + 1);
  float lo = from_bits(lo_b), hi = from_bits(hi_b);
  if (!isfinite(hi)) return nearest;
  double p_hi = (static_cast<double>(a) - lo) / (static_cast<double>(hi) - lo);
  uint16_t b = static_cast<double>(u) < p_hi ? hi_b : lo_b;
  return static_cast<uint16_t>(b | sign);
}

// Element i of a 16-bit (or f32) destination of dtype t: x rounded stochastically with word i of
// `seed` (philox_uniform(seed, 0, i)), or to nearest when seed is 0.
__device__ __forceinline__ void store_rounded(void* dst, DType t, int64_t i, float x, uint64_t seed) {
  switch (t) {
    case DType::BF16:
      static_cast<uint16_t*>(dst)[i] = seed ? round_stochastic<true>(x, philox_uniform(seed, 0, i))
                                            : __bfloat16_as_ushort(__float2bfloat16_rn(x));
      break;
    case DType::F16:
      static_cast<uint16_t*>(dst)[i] = seed ? round_stochastic<false>(x, philox_uniform(seed, 0, i))
                                            : __half_as_ushort(__float2half_rn(x));
      break;
    default: static_cast<float*>(dst)[i] = x; break;
  }
}

}  // namespace kestrel::cuda_ops
