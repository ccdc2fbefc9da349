// Private: rotary position embedding kernel slot (rotate-half form, see kestrel/ops/rope.h).
#pragma once

#include "kernels/registry.h"
#include "kestrel/ops/rope.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::kernels {

// out, x [tokens, heads, D] contiguous, same dtype; positions [tokens] i32/i64 contiguous.
// freqs validated by the op (rotary_dim even, <= D). inverse = rotate by -angle (the transpose of the
// rotation; with the same scaling it is rope's backward).
using RopeFn = void(const Tensor& out, const Tensor& x, const Tensor& positions, const RopeFrequencies& freqs,
                    bool inverse);
inline KernelSlot<RopeFn> rope;

}  // namespace kestrel::kernels
