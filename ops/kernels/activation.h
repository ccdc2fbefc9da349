// Private: activation kernel slots, forward and backward side by side. All tensors contiguous, one dtype.
#pragma once

#include "kernels/fp8.h"
#include "kernels/registry.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::kernels {

enum class Activation { Silu, GeluErf, GeluTanh, Relu };

using ActivationFn = void(Activation kind, const Tensor& out, const Tensor& x);
// dx = dy * act'(x).
using ActivationBackwardFn = void(Activation kind, const Tensor& dx, const Tensor& x, const Tensor& dy);
// out = silu(gate) * up.
using SwigluFn = void(const Tensor& out, const Tensor& gate, const Tensor& up);
// dgate = dy * up * silu'(gate), dup = dy * silu(gate).
using SwigluBackwardFn = void(const Tensor& dgate, const Tensor& dup, const Tensor& gate, const Tensor& up,
                              const Tensor& dy);

// out = silu(gate) * up over [R, C], writing in the same pass the FP8 copy of out (as stored) into
// `fp8` (kernels/fp8.h). Returns false, having written nothing, when the device kernel does not take
// this shape or layout (the op then runs swiglu_forward and the cast). No CPU kernel.
using SwigluFp8Fn = bool(const Tensor& out, const Tensor& gate, const Tensor& up, const Fp8CastTarget& fp8);

// SwiGLU's backward over [R, C] writing, in one pass, the FP8 casts of dgate and dup into their
// targets (each the cast of the gradient rounded to gate's dtype, as swiglu_backward then fp8_cast
// would write it; the 16-bit gradients themselves are not stored). The two targets have the same
// padded rows and the same layouts. Returns false, having written nothing, when the device kernel
// does not take this shape or layout (the op then runs swiglu_backward and the casts). No CPU kernel.
using SwigluFp8BackwardFn = bool(const Fp8CastTarget& dgate, const Fp8CastTarget& dup, const Tensor& gate,
                                 const Tensor& up, const Tensor& dy);

inline KernelSlot<ActivationFn> activation_forward;
inline KernelSlot<ActivationBackwardFn> activation_backward;
inline KernelSlot<SwigluFn> swiglu_forward;
inline KernelSlot<SwigluFp8Fn> swiglu_fp8_forward;
inline KernelSlot<SwigluBackwardFn> swiglu_backward;
inline KernelSlot<SwigluFp8BackwardFn> swiglu_fp8_backward;

}  // namespace kestrel::kernels
