// Private: activation kernel slots, forward and backward side by side. All tensors contiguous, one dtype.
#pragma once

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

inline KernelSlot<ActivationFn> activation_forward;
inline KernelSlot<ActivationBackwardFn> activation_backward;
inline KernelSlot<SwigluFn> swiglu_forward;
inline KernelSlot<SwigluBackwardFn> swiglu_backward;

}  // namespace kestrel::kernels
