// The 8-bit block-wise code of AdamW's moments (optimizer.state_dtype "q8"), shared by the CPU
// reference (ops/cpu/optim.cpp), the CUDA kernel (ops/cuda/optim_q8.cu) and the host-offload loops
// (train/src/host_adamw_q8.cpp), so all three encode and decode the same bits.
//
// Layout: a tensor of n moments is cut into blocks of kQ8Block = 2048 consecutive elements (the last
// may be shorter); each block stores one f32 scale (its absmax) and n one-byte codes. 2048: the scale
// costs 4 / 2048 = 0.2% of the state, one CUDA thread block (256 threads x 8 elements) holds a whole
// block in registers so dequantise -> update -> absmax -> requantise is one pass with one block-wide
// reduction, and the host update splits cleanly along blocks. Smaller blocks (torchao uses 256) track
// local magnitudes better but cost more scale bytes and reductions; bitsandbytes' block-wise 8-bit
// Adam uses 2048 as well.
//
// The code is logarithmic, 8 steps per octave (ratio 2^(1/8) = 1.0905 between neighbours), of the
// value divided by the block's absmax:
//   v (unsigned, >= 0): code 0 = 0; code c in [1, 255] = 2^(-(255 - c) / 8), i.e. 1 down to 2^-31.75
//                       (3.0e-10), enough for v ~ g^2 of gradients spanning 1.7e-5 of the block's largest.
//   m (signed): bit 7 the sign, bits 0..6 the magnitude k: 0 = 0, k in [1, 127] = 2^(-(127 - k) / 8),
//                       i.e. 1 down to 2^-15.75 (1.8e-5): the same relative range as v's square root.
// Like the dynamic (exponent-coded) maps of bitsandbytes and torchao, the code has constant relative
// precision across magnitudes (what m / sqrt(v) needs element by element) rather than linear steps
// that would flush a block's small elements to zero; unlike them it is a closed form, so encoding is
// a few bit operations and comparisons (no table search) and decoding is exact: M[r] * 2^-q with the
// nine f32 constants M below, the same bits on every device.
//
// Rounding: stochastic between the two neighbouring codes, P(upper) = (x - lo) / (hi - lo) against a
// Philox uniform (a per-step seed; element i of the tensor draws word i), or to nearest with u = 0.5
// (seed 0). Stochastic rounding matters here: with nearest rounding a moment only moves when the EMA
// step (1 - beta) * (g - m) exceeds half a code step (4.4% of m), so v with beta2 = 0.999 would stop
// following the gradients; stochastic rounding is unbiased and has no such dead band. Values below
// the smallest code: m rounds stochastically between 0 and the smallest code; a nonzero v rounds up
// to the smallest code (never to 0: m / (sqrt(0) + eps) would blow the update up). NaN in a block
// makes its scale NaN (the absmax propagates NaN), so the whole block decodes to NaN and the run's
// non-finite check sees it.
#pragma once

#include <bit>
#include <cstdint>

#include "kestrel/runtime/philox.h"

namespace kestrel::q8 {

constexpr int64_t kBlock = 2048;
constexpr int kMaxMagnitudeM = 127, kMaxCodeV = 255;

inline int64_t num_blocks(int64_t n) { return (n + kBlock - 1) / kBlock; }

KESTREL_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  return std::bit_cast<uint32_t>(x);
#endif
}
KESTREL_HD float bits_float(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  return std::bit_cast<float>(b);
#endif
}

// M[r] = 2^(-r / 8) rounded to f32 (r = 0..8; M[8] = 0.5 closes the octave).
KESTREL_HD float mantissa(int r) {
  constexpr float M[9] = {1.0f,        0.917004049f, 0.840896428f, 0.771105409f, 0.707106769f,
                          0.648419797f, 0.594603539f, 0.545253873f, 0.5f};
  return M[r];
}

// 2^-d/8 as M[d % 8] * 2^-(d / 8): exact (a power-of-two scaling of an f32 constant).
KESTREL_HD float level(int d) { return mantissa(d & 7) * bits_float(static_cast<uint32_t>(127 - (d >> 3)) << 23); }

// Magnitude code of x = |value| / absmax in [0, 1]: 0 for zero, kmax for 1, kmax - d for 2^(-d/8).
// u: a uniform in [0, 1) (0.5 rounds to nearest). keep_nonzero: a positive x never becomes 0 (v).
KESTREL_HD int encode_magnitude(float x, int kmax, float u, bool keep_nonzero) {
  if (!(x > 0.0f)) return 0;  // zero, or NaN (the block's scale is NaN then: it decodes to NaN anyway)
  if (x >= 1.0f) return kmax;
  const int dmin = kmax - 1;  // the smallest nonzero code's distance from the top
  const uint32_t b = float_bits(x);
  const int e = static_cast<int>(b >> 23);  // biased exponent (x > 0: no sign bit)
  const int q = 126 - e;                     // x in [2^-(q+1), 2^-q)
  const float smallest = level(dmin);
  if (e == 0 || q > (dmin >> 3) || x < smallest) {  // below the smallest code (subnormals included)
    if (keep_nonzero) return 1;
    return u < x / smallest ? 1 : 0;
  }
  const float f = bits_float((b & 0x7fffffu) | (126u << 23));  // x / 2^-q in [0.5, 1)
  int r = 0;  // the largest r with M[r] >= f (M[0] = 1 > f)
  for (int k = 1; k < 8; ++k) r += mantissa(k) >= f ? 1 : 0;
  const int d_hi = (q << 3) + r;
  const float hi = mantissa(r), lo = mantissa(r + 1);
  if (f == hi || d_hi == dmin) return kmax - d_hi;  // exact, or x == smallest
  // Both neighbours are codes: P(upper) = (f - lo) / (hi - lo) (the subtractions are exact).
  const float p = (f - lo) / (hi - lo);
  return kmax - (u < p ? d_hi : d_hi + 1);
}

// Stored byte of a signed moment m (scale: the block's absmax, > 0).
KESTREL_HD uint8_t encode_m(float m, float scale, float u) {
  const float a = m < 0.0f ? -m : m;
  const int k = encode_magnitude(a / scale, kMaxMagnitudeM, u, false);
  return static_cast<uint8_t>(k == 0 ? 0 : (m < 0.0f ? 0x80 | k : k));
}
KESTREL_HD uint8_t encode_v(float v, float scale, float u) {
  return static_cast<uint8_t>(encode_magnitude(v / scale, kMaxCodeV, u, true));
}

// Decoded values relative to the scale (multiply by the block's scale to get the moment).
KESTREL_HD float decode_m(uint8_t c) {
  const int k = c & 0x7f;
  if (k == 0) return 0.0f;
  const float a = level(kMaxMagnitudeM - k);
  return (c & 0x80) ? -a : a;
}
KESTREL_HD float decode_v(uint8_t c) { return c == 0 ? 0.0f : level(kMaxCodeV - c); }

// The block absmax, NaN-propagating (fmax would drop a NaN and hide it).
KESTREL_HD float absmax_step(float acc, float x) {
  const float a = x < 0.0f ? -x : x;
  return (a > acc || a != a) ? a : acc;
}

// The Philox streams of one step: parameter rounding uses `seed` (as adamw_step's copy), the
// moments two streams derived from the moment seed. 0 stays 0 (round to nearest).
KESTREL_HD uint64_t m_stream(uint64_t seed) { return seed ? seed ^ 0x6a09e667f3bcc909ull : 0; }
KESTREL_HD uint64_t v_stream(uint64_t seed) { return seed ? seed ^ 0xbb67ae8584caa73bull : 0; }
KESTREL_HD float uniform_or_half(uint64_t seed, uint64_t i) { return seed ? philox_uniform(seed, 0, i) : 0.5f; }

}  // namespace kestrel::q8
