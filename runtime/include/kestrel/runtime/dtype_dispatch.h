// Compile-time dispatch over DType, and scalar conversions between element types.
// CPU kernels compute in compute_t<T>: double for f64 storage, float otherwise.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kestrel/runtime/dtype.h"
#include "kestrel/runtime/error.h"

namespace kestrel {

template <typename T>
using compute_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T>
inline compute_t<T> to_compute(T v) {
  if constexpr (std::is_same_v<T, double>) return v;
  else return static_cast<float>(v);
}

template <typename T>
inline T from_compute(compute_t<T> v) {
  if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>) return v;
  else return T(v);
}

template <typename T>
inline float elem_to_float(T v) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>)
    return static_cast<float>(v);
  else
    return static_cast<float>(v);
}

template <typename T>
inline double elem_to_double(T v) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>)
    return static_cast<double>(static_cast<float>(v));
  else
    return static_cast<double>(v);
}

template <typename T>
inline T elem_from_double(double v) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>)
    return T(static_cast<float>(v));
  else if constexpr (std::is_same_v<T, bool>)
    return v != 0.0;
  else
    return static_cast<T>(v);
}

template <typename T>
inline T elem_from_float(float v) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>)
    return T(v);
  else if constexpr (std::is_same_v<T, bool>)
    return v != 0.0f;
  else
    return static_cast<T>(v);
}

// f(T{}) with T the C++ element type of `t`.
template <typename F>
decltype(auto) dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::F32: return f(float{});
    case DType::BF16: return f(bf16{});
    case DType::F16: return f(f16{});
    case DType::I32: return f(int32_t{});
    case DType::I64: return f(int64_t{});
    case DType::U8: return f(uint8_t{});
    case DType::Bool: return f(bool{});
    case DType::F64: return f(double{});
  }
  throw make_error("dtype", "invalid dtype");
}

// Floating types only (f32, bf16, f16).
template <typename F>
decltype(auto) dispatch_floating(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::F32: return f(float{});
    case DType::BF16: return f(bf16{});
    case DType::F16: return f(f16{});
    case DType::F64: return f(double{});
    default: break;
  }
  throw make_error(op, "expected a floating dtype (f32, bf16, f16, f64), got ", dtype_name(t));
}

}  // namespace kestrel
