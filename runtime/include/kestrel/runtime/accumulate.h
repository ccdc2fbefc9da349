// Raw in-place accumulation (dst += src), the one arithmetic the autograd engine needs from the
// runtime: gradient accumulation into leaves and into gradients of values used several times.
#pragma once

#include "kestrel/runtime/tensor.h"

namespace kestrel {
// Same shape and device; floating dtypes (may differ: src converts to dst's type); any strides.
void add_into(const Tensor& dst, const Tensor& src);
// Synchronises the device's compute stream (no-op on the CPU).
void synchronize(Device device);
}  // namespace kestrel
