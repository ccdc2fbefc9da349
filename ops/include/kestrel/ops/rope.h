// Rotary position embedding, rotate-half form (Llama/Qwen2 in Hugging Face):
//   inv_freq[i] = theta^(-2i / rotary_dim), angle = position * inv_freq[i] for i < rotary_dim/2,
//   y[i] = x[i] cos - x[i + half] sin,  y[i + half] = x[i + half] cos + x[i] sin.
// Positions are given per token, so packed documents restart at 0. Differentiable in x.
#pragma once

#include "kestrel/runtime/tensor.h"

namespace kestrel {

// x [tokens, heads, D]; positions [tokens] (i32 or i64); rotary_dim even, <= D (-1 = D);
// dimensions past rotary_dim pass through. Angles computed in f64 on the CPU, f32 on CUDA.
Tensor rope(const Tensor& x, const Tensor& positions, double theta, int64_t rotary_dim = -1);

}  // namespace kestrel
