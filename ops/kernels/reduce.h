// Private: reduction kernel slots.
#pragma once

#include "kernels/registry.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::kernels {

// out[keepdim shape] = sum of x over the dims where out has size 1 and x does not.
// `out` is contiguous with x's rank (keepdim form).
using SumFn = void(const Tensor& out, const Tensor& x);
inline KernelSlot<SumFn> sum;

}  // namespace kestrel::kernels
