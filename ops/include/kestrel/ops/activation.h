// Activations. Differentiable.
#pragma once

#include "kestrel/runtime/tensor.h"

namespace kestrel {

Tensor silu(const Tensor& x);                           // x * sigmoid(x)
Tensor gelu(const Tensor& x, bool tanh_approx = false);  // exact erf form, or the tanh form (gelu_pytorch_tanh)
Tensor relu(const Tensor& x);
// silu(gate) * up in one pass (the SwiGLU MLP); gate and up of one shape.
Tensor swiglu(const Tensor& gate, const Tensor& up);

}  // namespace kestrel
