// Private: launchers of the device's raw data kernels (copy_kernels.cu), on the current stream.
#pragma once

#include <cstdint>

#include "kestrel/runtime/tensor.h"

namespace kestrel::cuda {
void launch_strided_copy(const Tensor& dst, const Tensor& src);  // same shape, any strides/dtypes but f64
void launch_fill(const Tensor& dst, double value);
void launch_add_into(const Tensor& dst, const Tensor& src);      // dst += src, floating dtypes
// Philox uniform [a, b) or normal (mean a, std b) into a contiguous floating tensor, bit-identical
// (uniform) to random.cpp's host stream for the same (seed, offset).
void launch_fill_random(const Tensor& dst, bool normal, uint64_t seed, uint64_t offset, double a, double b);
}  // namespace kestrel::cuda
