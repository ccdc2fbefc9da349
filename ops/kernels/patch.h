// Private: unfold/fold kernel slots for patch embedding (stride = kernel = P, no overlap).
#pragma once

#include "kernels/registry.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::kernels {

// cols [B, Hp*Wp, C*P*P] (column c*P*P + i*P + j) from images [B, C, H, W] contiguous;
// Hp = H / P, Wp = W / P (trailing pixels dropped).
using UnfoldFn = void(const Tensor& cols, const Tensor& images, int64_t patch);
// The transpose: dimages [B, C, H, W] (dropped pixels get 0) from dcols.
using FoldFn = void(const Tensor& dimages, const Tensor& dcols, int64_t patch);

inline KernelSlot<UnfoldFn> unfold_patches;
inline KernelSlot<FoldFn> fold_patches;

}  // namespace kestrel::kernels
