// Rotary position embedding, rotate-half form (Llama/Qwen2 in Hugging Face):
//   angle = position * inv_freq[i] for i < rotary_dim/2,
//   y[i] = s (x[i] cos - x[i + half] sin),  y[i + half] = s (x[i + half] cos + x[i] sin),
// where inv_freq and the scale s come from a RopeFrequencies table. The plain table is
// inv_freq[i] = theta^(-2i / rotary_dim), s = 1; scaled variants (linear, llama3, yarn, ...) are
// built by the model config (kestrel/models/rope_scaling.h) once, and the CPU reference and the
// CUDA kernel read the same table. Positions are given per token, so packed documents restart at 0.
// Differentiable in x.
#pragma once

#include <cstdint>
#include <vector>

#include "kestrel/runtime/tensor.h"

namespace kestrel {

// The per-frequency table of a rotary embedding.
struct RopeFrequencies {
  std::vector<double> inv_freq;   // [rotary_dim / 2], radians per position
  double attention_scaling = 1.0;  // multiplies cos and sin (YaRN's attention factor; 1 otherwise)

  int64_t rotary_dim() const { return 2 * static_cast<int64_t>(inv_freq.size()); }
  // inv_freq[i] = theta^(-2i / rotary_dim), scaling 1.
  static RopeFrequencies standard(double theta, int64_t rotary_dim);
};

// Largest rotary_dim / 2 the CUDA kernel takes (its table is a kernel parameter).
inline constexpr int64_t kRopeMaxFrequencies = 256;

// x [tokens, heads, D]; positions [tokens] (i32 or i64); freqs.rotary_dim() even, <= D; dimensions
// past rotary_dim pass through. Angles computed in f64 on the CPU, f64 reduced mod 2 pi then f32
// sin/cos on CUDA.
Tensor rope(const Tensor& x, const Tensor& positions, const RopeFrequencies& freqs);
// The plain table: rotary_dim even, <= D (-1 = D).
Tensor rope(const Tensor& x, const Tensor& positions, double theta, int64_t rotary_dim = -1);

}  // namespace kestrel
