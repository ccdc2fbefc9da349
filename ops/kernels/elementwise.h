// Private: elementwise kernel slots. Inputs arrive broadcast to the output's shape (expand views),
// the output is freshly allocated and contiguous. Kernels compute in f32 (f64 for f64 storage).
#pragma once

#include "kernels/registry.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::kernels {

enum class BinaryOp { Add, Sub, Mul, Div, Maximum, Minimum };
// Unary ops with one scalar parameter s (ignored by most).
enum class UnaryOp { Neg, Exp, Log, Sqrt, Rsqrt, Tanh, Abs, Sigmoid, Square, Scale, AddScalar, PowScalar, Sign };

using BinaryFn = void(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b);
using UnaryFn = void(UnaryOp op, const Tensor& out, const Tensor& x, double s);
// out = cond ? a : b (cond: bool/u8 or any nonzero), all broadcast to out.
using WhereFn = void(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b);

inline KernelSlot<BinaryFn> binary;
inline KernelSlot<UnaryFn> unary;
inline KernelSlot<WhereFn> where;

}  // namespace kestrel::kernels
