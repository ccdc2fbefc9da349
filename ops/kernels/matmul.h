// Private: matmul kernel slot.
#pragma once

#include "kernels/registry.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::kernels {

// out[b] = alpha * a[b] @ b_[b] (+ bias broadcast over rows) (+ beta * out[b] when beta != 0)
// out: [B, M, N] contiguous. a: [B, M, K], b_: [B, K, N], any strides (transposes arrive as
// permuted views; a batch stride of 0 means a shared operand). bias: [N] or undefined.
using MatmulFn = void(const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& bias, double alpha,
                      double beta);
inline KernelSlot<MatmulFn> matmul;

}  // namespace kestrel::kernels
