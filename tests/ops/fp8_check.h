// Shared by the FP8 tests (CPU and CUDA): an independent float64 model of linear_fp8's quantised maths,
// written from the definitions (kestrel/ops/fp8.h), not from the kernels.
#pragma once

#include <cfloat>
#include <cmath>
#include <vector>

#include "kestrel/ops/fp8.h"

namespace kestrel::testing {

// The value of every fp8 code derived from its bit fields with pow() (a second derivation, checked
// against fp8_to_float exhaustively). NaN for NaN codes, +-inf for e5m2's infinities.
inline double fp8_value_from_bits(uint8_t code, Fp8Format f) {
  const int mbits = f == Fp8Format::E4M3 ? 3 : 2, ebits = 7 - mbits, bias = f == Fp8Format::E4M3 ? 7 : 15;
  const int e = (code >> mbits) & ((1 << ebits) - 1), m = code & ((1 << mbits) - 1);
  const double sign = (code & 0x80) ? -1.0 : 1.0;
  if (f == Fp8Format::E4M3 && e == 15 && m == 7) return NAN;
  if (f == Fp8Format::E5M2 && e == 31) return m == 0 ? sign * INFINITY : NAN;
  if (e == 0) return sign * (m / std::pow(2.0, mbits)) * std::pow(2.0, 1 - bias);
  return sign * (1.0 + m / std::pow(2.0, mbits)) * std::pow(2.0, e - bias);
}

// The scale delayed scaling derives from an amax (f32 arithmetic, as the kernels do); `previous`
// when amax is zero or not finite.
inline float ref_scale(float amax, Fp8Format f, int margin, float previous = 1.0f) {
  if (!std::isfinite(amax) || !(amax > 0.0f)) return previous;
  const float s = static_cast<float>(fp8_max(f)) / (amax * std::ldexp(1.0f, margin));
  return std::isinf(s) ? FLT_MAX : s;
}

inline float ref_amax(const std::vector<float>& x) {
  float m = 0.0f;
  for (float v : x) m = std::max(m, std::fabs(v));
  return m;
}

// Decoded fp8 values (not yet multiplied by 1/scale) of x * scale.
inline std::vector<double> ref_quantize(const std::vector<float>& x, float scale, Fp8Format f) {
  std::vector<double> q(x.size());
  for (size_t i = 0; i < x.size(); ++i) q[i] = fp8_value_from_bits(float_to_fp8(x[i] * scale, f), f);
  return q;
}

// out [M, N] = a [M, K] . b [N, K]^T / (sa * sb), in f64.
inline std::vector<double> ref_gemm_nt(const std::vector<double>& a, const std::vector<double>& b, int64_t M,
                                       int64_t N, int64_t K, float sa, float sb) {
  std::vector<double> out(static_cast<size_t>(M * N));
  const double inv = static_cast<double>(1.0f / sa) * static_cast<double>(1.0f / sb);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0.0;
      for (int64_t k = 0; k < K; ++k) acc += a[m * K + k] * b[n * K + k];
      out[m * N + n] = acc * inv;
    }
  return out;
}

// [R, C] -> [C, R]
template <typename T>
std::vector<T> transposed(const std::vector<T>& x, int64_t R, int64_t C) {
  std::vector<T> t(x.size());
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) t[c * R + r] = x[r * C + c];
  return t;
}

// Output and gradients of y = x W^T with the scales sx (x), sw (w), sg (dy). x [T, K], w [N, K],
// dy [T, N] as host floats.
struct Fp8LinearReference {
  std::vector<double> y, dx, dw;
};
inline Fp8LinearReference ref_linear_fp8(const std::vector<float>& x, const std::vector<float>& w,
                                         const std::vector<float>& dy, int64_t T, int64_t K, int64_t N,
                                         Fp8Format grad_format, float sx, float sw, float sg) {
  Fp8LinearReference r;
  const std::vector<double> x8 = ref_quantize(x, sx, Fp8Format::E4M3), w8 = ref_quantize(w, sw, Fp8Format::E4M3),
                            g8 = ref_quantize(dy, sg, grad_format);
  r.y = ref_gemm_nt(x8, w8, T, N, K, sx, sw);
  r.dx = ref_gemm_nt(g8, transposed(w8, N, K), T, K, N, sg, sw);
  r.dw = ref_gemm_nt(transposed(g8, T, N), transposed(x8, T, K), N, K, T, sg, sx);
  return r;
}

}  // namespace kestrel::testing
