// Rotary scaling as transformers 5 defines it (modeling_rope_utils.py): the parsed rope parameters of
// a text config and the per-frequency table they give, computed once per model and handed to the
// rope op (kestrel/ops/rope.h), so the CPU reference and the CUDA kernel rotate by the same angles.
//
// Supported rope_type values and what they change (dim = rotary dims, base = rope_theta,
// inv[i] = base^(-2i/dim)):
//   default  inv.
//   linear   inv / factor.
//   dynamic  NTK: base' = base * (factor * L / max_position_embeddings - (factor - 1))^(dim / (dim - 2))
//            for a sequence of L > max_position_embeddings tokens, else default. transformers keeps the
//            frequencies of the longest sequence seen so far (a stateful inference rule), so training
//            past max_position_embeddings is refused by the decoder; up to it the table is default.
//   llama3   per frequency by wavelength 2 pi / inv against original_max_position_embeddings /
//            low_freq_factor (longer: inv / factor) and / high_freq_factor (shorter: inv), smoothly
//            interpolated between.
//   yarn     a ramp between interpolated (inv / factor) and extrapolated (inv) frequencies over the
//            dims found from beta_fast / beta_slow rotations in original_max_position_embeddings
//            (floored/ceiled unless truncate is false), and cos/sin scaled by attention_factor
//            (default 0.1 ln(factor) + 1, or the mscale / mscale_all_dim ratio).
// Anything else (longrope, ...) is refused at config parse time with the list above.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "kestrel/ops/rope.h"

namespace kestrel::models {

// One rope_scaling / rope_parameters object, with transformers' defaults filled in at parse time.
struct RopeScaling {
  std::string rope_type = "default";
  std::optional<double> factor;            // linear, dynamic, llama3 (required); yarn (null: max / original)
  int64_t original_max_position_embeddings = 0;  // llama3, yarn; defaults to max_position_embeddings
  double low_freq_factor = 0, high_freq_factor = 0;  // llama3 (required)
  std::optional<double> attention_factor;  // yarn
  std::optional<double> beta_fast, beta_slow, mscale, mscale_all_dim;  // yarn
  bool truncate = true;                    // yarn

  bool is_default() const { return rope_type == "default"; }
};

// The rope types this build implements, for error messages: "default, linear, dynamic, llama3, yarn".
const char* supported_rope_types();

// The frequency table of `scaling` for rotary_dim dims at base `theta`. `seq_len` is the longest
// sequence (max position + 1) of the batch; it only matters for "dynamic".
RopeFrequencies rope_frequencies(const RopeScaling& scaling, double theta, int64_t rotary_dim,
                                 int64_t max_position_embeddings, int64_t seq_len = 0);

}  // namespace kestrel::models
