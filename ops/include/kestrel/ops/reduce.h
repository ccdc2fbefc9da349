// Reductions. Long sums accumulate in f64 on the CPU.
#pragma once

#include <vector>

#include "kestrel/runtime/tensor.h"

namespace kestrel {

// Sum over `dims` (all dims when empty). Output dtype = input dtype.
Tensor sum(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
// Sums a broadcast gradient back down to `shape` (the inverse of expand).
Tensor sum_to(const Tensor& x, const Shape& shape);

}  // namespace kestrel
