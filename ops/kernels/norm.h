// Private: normalisation kernel slots. Rows are the flattened leading dims: x [rows, C] contiguous,
// weight/bias [C] contiguous, x's dtype. Statistics (rstd, mean) [rows] are f32 (f64 for f64 input)
// and are saved for backward. Weight/bias gradients are column sums over rows, deterministic.
#pragma once

#include "kernels/registry.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::kernels {

// y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps).
using RmsNormFn = void(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& w, double eps);
// h = x + res; y = rms_norm(h) (h written out, it is the residual stream).
using AddRmsNormFn = void(const Tensor& y, const Tensor& h, const Tensor& rstd, const Tensor& x, const Tensor& res,
                          const Tensor& w, double eps);
// dx = rstd * (dy*w - xhat * mean(dy*w*xhat)); dw = sum_rows(dy * xhat). dw may be undefined.
using RmsNormBackwardFn = void(const Tensor& dx, const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                               const Tensor& rstd);
// y = (x - mean) * rstd * w + b; w and b may be undefined (identity / zero).
using LayerNormFn = void(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x, const Tensor& w,
                         const Tensor& b, double eps);
// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy*w; dw = sum_rows(dy*xhat), db = sum_rows(dy).
using LayerNormBackwardFn = void(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dy,
                                 const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd);

inline KernelSlot<RmsNormFn> rms_norm_forward;
inline KernelSlot<AddRmsNormFn> add_rms_norm_forward;
inline KernelSlot<RmsNormBackwardFn> rms_norm_backward;
inline KernelSlot<LayerNormFn> layer_norm_forward;
inline KernelSlot<LayerNormBackwardFn> layer_norm_backward;

}  // namespace kestrel::kernels
