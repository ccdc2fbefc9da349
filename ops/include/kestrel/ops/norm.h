// Normalisation over the last dimension. Differentiable (x, weight, bias).
#pragma once

#include <utility>

#include "kestrel/runtime/tensor.h"

namespace kestrel {

// y = x / sqrt(mean(x^2) + eps) * weight; x [..., C], weight [C]. Statistics in f32.
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps);
// h = x + residual; returns {rms_norm(h, weight, eps), h} in one pass (the decoder's pre-norm).
std::pair<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, double eps);
// y = (x - mean) / sqrt(var + eps) * weight + bias (biased variance, as torch); weight/bias [C] or undefined.
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps);

}  // namespace kestrel
