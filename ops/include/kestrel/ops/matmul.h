// Matrix products. Differentiable.
#pragma once

#include "kestrel/runtime/tensor.h"

namespace kestrel {

// a: [..., M, K] ([..., K, M] when trans_a), b: [..., K, N] ([..., N, K] when trans_b).
// Batch dims must match, or b may be 2-D (shared across the batch). Same dtype for a and b.
Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a = false, bool trans_b = false);

// y = x @ weight^T + bias, as torch.nn.Linear: x [..., in], weight [out, in], bias [out] or undefined.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());

}  // namespace kestrel
