// Patch embedding for the vision tower: a stride-P, kernel-P convolution (HF SiglipVisionEmbeddings
// patch_embedding) expressed as unfold + matmul.
#pragma once

#include "kestrel/runtime/tensor.h"

namespace kestrel {

// images [B, C, H, W] (NCHW, as HF pixel_values), weight [E, C, P, P], bias [E] or undefined
// -> [B, (H/P) * (W/P), E], patches in row-major order. H and W need not be multiples of P: the
// trailing pixels are dropped, as a stride-P convolution does. Differentiable in all three.
Tensor patch_embed(const Tensor& images, const Tensor& weight, const Tensor& bias, int64_t patch);

}  // namespace kestrel
