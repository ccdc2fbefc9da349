// Element types and exact conversions between float and the 16-bit floating formats.
//
// bf16/f16 conversions from float round to nearest, ties to even; NaN stays NaN (quiet),
// infinities and signed zeros are preserved; f16 handles subnormals exactly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace kestrel {

// F64 is an addition to the architecture's list: the CPU kernels accept it so that tests and the
// finite-difference checker can run the real ops in float64 (CUDA kernels do not take it).
enum class DType : uint8_t { F32, BF16, F16, I32, I64, U8, Bool, F64 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::F16: return 2;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::U8: return 1;
    case DType::Bool: return 1;
    case DType::F64: return 8;
  }
  return 0;
}

constexpr bool is_floating(DType t) {
  return t == DType::F32 || t == DType::BF16 || t == DType::F16 || t == DType::F64;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::BF16: return "bf16";
    case DType::F16: return "f16";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::U8: return "u8";
    case DType::Bool: return "bool";
    case DType::F64: return "f64";
  }
  return "?";
}

// Parses "f32", "f64", "bf16", "f16", "i32", "i64", "u8", "bool" (also "float32", "bfloat16", "float16").
DType parse_dtype(std::string_view name);

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- bfloat16 ----
inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;  // round to nearest even; overflow rounds to inf correctly
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_bits_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// ---- IEEE half ----
uint16_t float_to_f16_bits(float f);
float f16_bits_to_float(uint16_t h);

// Storage wrappers: trivially copyable 2-byte values.
struct bf16 {
  uint16_t bits;
  bf16() = default;
  explicit bf16(float f) : bits(float_to_bf16_bits(f)) {}
  explicit operator float() const { return bf16_bits_to_float(bits); }
  static bf16 from_bits(uint16_t b) { bf16 r; r.bits = b; return r; }
};
struct f16 {
  uint16_t bits;
  f16() = default;
  explicit f16(float f) : bits(float_to_f16_bits(f)) {}
  explicit operator float() const { return f16_bits_to_float(bits); }
  static f16 from_bits(uint16_t b) { f16 r; r.bits = b; return r; }
};

}  // namespace kestrel
