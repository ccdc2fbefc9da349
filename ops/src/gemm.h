// Private: a GEMM written into a given output (a row range of a larger tensor, or a gradient that
// accumulates), for ops that tile their work. matmul/linear are the differentiable front ends.
#pragma once

#include "kestrel/runtime/tensor.h"

namespace kestrel::detail {

// out [M, N] (contiguous rows) = op(a) @ op(b) + beta * out, with op(a) [M, K] and op(b) [K, N]
// (transposed views when ta/tb). 2-D operands of one dtype and device; no tape.
void gemm_into(const Tensor& out, const Tensor& a, const Tensor& b, bool ta, bool tb, double beta);

}  // namespace kestrel::detail
