// Elementwise operations with numpy broadcasting. Differentiable.
// Mixed floating dtypes promote to f32 (f64 if either is f64); same dtypes keep theirs.
#pragma once

#include "kestrel/runtime/tensor.h"

namespace kestrel {

Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);  // gradient to the larger (a on ties)
Tensor minimum(const Tensor& a, const Tensor& b);

Tensor neg(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor abs(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor square(const Tensor& x);
Tensor scale(const Tensor& x, double s);       // x * s
Tensor add_scalar(const Tensor& x, double s);  // x + s
Tensor pow_scalar(const Tensor& x, double p);  // x ^ p
// cond ? a : b; cond is bool/u8 (or any dtype, nonzero = true), not differentiated.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);

inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator-(const Tensor& x) { return neg(x); }
inline Tensor operator*(const Tensor& x, double s) { return scale(x, s); }
inline Tensor operator*(double s, const Tensor& x) { return scale(x, s); }

// Result dtype of a binary op on (a, b).
DType promote_types(DType a, DType b, const char* op);

}  // namespace kestrel
