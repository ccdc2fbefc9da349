// Differentiable views and layout changes. Views share storage with their input.
#pragma once

#include <vector>

#include "kestrel/runtime/tensor.h"

namespace kestrel {

Tensor reshape(const Tensor& x, const Shape& shape);  // a view when contiguous, else a copy; one dim may be -1
Tensor permute(const Tensor& x, const std::vector<int64_t>& dims);
Tensor transpose(const Tensor& x, int64_t d0, int64_t d1);
Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length);
Tensor unsqueeze(const Tensor& x, int64_t dim);
Tensor squeeze(const Tensor& x, int64_t dim);
Tensor expand(const Tensor& x, const Shape& shape);  // broadcast view; backward sums
Tensor contiguous(const Tensor& x);
Tensor cast(const Tensor& x, DType dtype);            // backward casts the gradient back
Tensor to_device(const Tensor& x, Device device);     // backward moves the gradient back

}  // namespace kestrel
