// float <-> fp8 (e4m3 "fn": no infinities, 0x7f/0xff NaN; e5m2: IEEE-like with inf and NaN) on the host.
// The rounding is cuda_fp8.h's __NV_SATFINITE conversion: round to nearest, ties to even, at the
// format's precision (subnormals included); a magnitude past the largest finite value (infinity too)
// becomes that value with the sign kept; NaN becomes 0x7f.
#include <algorithm>
#include <cmath>

#include "kestrel/ops/fp8.h"

namespace kestrel {
namespace {

struct Fp8Layout {
  int mantissa_bits;
  int bias;
};

Fp8Layout layout_of(Fp8Format f) { return f == Fp8Format::E4M3 ? Fp8Layout{3, 7} : Fp8Layout{2, 15}; }

}  // namespace

uint8_t float_to_fp8(float x, Fp8Format f) {
  if (std::isnan(x)) return 0x7f;
  const Fp8Layout L = layout_of(f);
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  double a = std::min(static_cast<double>(std::fabs(x)), fp8_max(f));
  if (a == 0.0) return sign;
  // a = m * 2^e with m in [1, 2); below the normal range the quantum stays that of the smallest normal.
  int e2 = 0;
  std::frexp(a, &e2);  // a = fr * 2^e2, fr in [0.5, 1)
  const int emin = 1 - L.bias;
  const int e = std::max(e2 - 1, emin);
  const double quantum = std::ldexp(1.0, e - L.mantissa_bits);
  // a / quantum is exact (a power-of-two division of a float-valued double); rint rounds half to even.
  const double q = std::nearbyint(a / quantum);
  const int one = 1 << L.mantissa_bits;
  int exponent_field = 0, mantissa = 0;
  if (q < one) {  // subnormal (only at e == emin)
    exponent_field = 0;
    mantissa = static_cast<int>(q);
  } else if (q >= 2 * one) {  // rounded up into the next binade
    exponent_field = e + 1 + L.bias;
    mantissa = 0;
  } else {
    exponent_field = e + L.bias;
    mantissa = static_cast<int>(q) - one;
  }
  return static_cast<uint8_t>(sign | (exponent_field << L.mantissa_bits) | mantissa);
}

float fp8_to_float(uint8_t code, Fp8Format f) {
  const Fp8Layout L = layout_of(f);
  const bool negative = (code & 0x80) != 0;
  const int exponent_field = (code & 0x7f) >> L.mantissa_bits;
  const int mantissa = code & ((1 << L.mantissa_bits) - 1);
  const int max_field = (1 << (7 - L.mantissa_bits)) - 1;
  float v;
  if (f == Fp8Format::E4M3 && exponent_field == max_field && mantissa == (1 << L.mantissa_bits) - 1) {
    v = std::nanf("");
  } else if (f == Fp8Format::E5M2 && exponent_field == max_field) {
    v = mantissa == 0 ? INFINITY : std::nanf("");
  } else if (exponent_field == 0) {
    v = static_cast<float>(std::ldexp(static_cast<double>(mantissa), 1 - L.bias - L.mantissa_bits));
  } else {
    v = static_cast<float>(
        std::ldexp(static_cast<double>((1 << L.mantissa_bits) + mantissa), exponent_field - L.bias - L.mantissa_bits));
  }
  return negative ? -v : v;
}

}  // namespace kestrel
