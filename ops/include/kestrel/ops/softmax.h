// Softmax family along one dimension. Differentiable. Computed in f32 (f64 for f64) with the max
// subtracted; outputs in the input dtype.
#pragma once

#include "kestrel/runtime/tensor.h"

namespace kestrel {

Tensor softmax(const Tensor& x, int64_t dim = -1);
Tensor log_softmax(const Tensor& x, int64_t dim = -1);
Tensor logsumexp(const Tensor& x, int64_t dim = -1, bool keepdim = false);
// Maximum along dim; the gradient goes to the first maximal element.
Tensor amax(const Tensor& x, int64_t dim = -1, bool keepdim = false);

}  // namespace kestrel
