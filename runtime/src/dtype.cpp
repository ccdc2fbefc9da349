#include "kestrel/runtime/dtype.h"

#include "kestrel/runtime/error.h"

namespace kestrel {

DType parse_dtype(std::string_view n) {
  if (n == "f32" || n == "float32" || n == "float" || n == "F32") return DType::F32;
  if (n == "bf16" || n == "bfloat16" || n == "BF16") return DType::BF16;
  if (n == "f16" || n == "float16" || n == "half" || n == "F16") return DType::F16;
  if (n == "i32" || n == "int32" || n == "I32") return DType::I32;
  if (n == "i64" || n == "int64" || n == "I64") return DType::I64;
  if (n == "u8" || n == "uint8" || n == "U8") return DType::U8;
  if (n == "bool" || n == "BOOL") return DType::Bool;
  if (n == "f64" || n == "float64" || n == "double" || n == "F64") return DType::F64;
  throw make_error("dtype", "unknown dtype '", std::string(n),
                   "'; expected one of f32, f64, bf16, f16, i32, i64, u8, bool");
}

uint16_t float_to_f16_bits(float f) {
  uint32_t u = float_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t absu = u & 0x7fffffffu;
  if (absu > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((absu >> 13) & 0x3ffu));  // NaN
  if (absu >= 0x477ff000u) {
    // >= 65520 rounds to infinity (65504 is the largest finite half; ties-to-even at 65520).
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (absu < 0x38800000u) {
    // Result is subnormal (or zero) in half: value = m * 2^-24 with m in [0, 1024).
    if (absu < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25 rounds to zero
    uint32_t exp = absu >> 23;                                    // biased f32 exponent
    uint32_t mant = (absu & 0x7fffffu) | 0x800000u;               // 24-bit significand
    // value = mant * 2^(exp-127-23); in units of 2^-24: shift = (exp - 127 - 23) + 24 = exp - 126
    uint32_t shift = 126 - exp;                                   // right shift, 1..25
    uint32_t q = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  // Normal: rebias exponent (127 -> 15) and round the 23-bit mantissa to 10 bits.
  uint32_t v = absu - 0x38000000u;  // subtract (127-15) << 23
  uint32_t lsb = (v >> 13) & 1u;
  v += 0xfffu + lsb;
  return static_cast<uint16_t>(sign | (v >> 13));
}

float f16_bits_to_float(uint16_t h) {
  uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return bits_float(sign);
    // subnormal: mant * 2^-24
    float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

}  // namespace kestrel
