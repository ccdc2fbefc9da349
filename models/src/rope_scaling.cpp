// Rotary frequency tables per rope_type, following transformers 5's _compute_*_parameters (see the
// header for the formulas). Computed in f64 (transformers uses f32; the difference is ~1e-7 relative
// per frequency, far below the tolerance of any comparison with it).
#include "kestrel/models/rope_scaling.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "kestrel/runtime/error.h"

namespace kestrel::models {
namespace {
constexpr const char* kComp = "rope";
constexpr double kTwoPi = 2.0 * std::numbers::pi;

double required_factor(const RopeScaling& s) {
  KESTREL_CHECK(s.factor.has_value(), kComp, "rope_type '", s.rope_type, "' needs 'factor'");
  return *s.factor;
}

// YaRN's attention temperature: 1 for no extension, else 0.1 m ln(scale) + 1.
double yarn_mscale(double scale, double m) { return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; }

void apply_llama3(const RopeScaling& s, std::vector<double>& inv) {
  const double factor = required_factor(s);
  const double old_len = static_cast<double>(s.original_max_position_embeddings);
  const double low_wavelen = old_len / s.low_freq_factor, high_wavelen = old_len / s.high_freq_factor;
  for (double& f : inv) {
    const double wavelen = kTwoPi / f;
    if (wavelen > low_wavelen) {
      f /= factor;  // low frequencies: interpolated
    } else if (!(wavelen < high_wavelen)) {  // medium: blend
      const double smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      f = (1.0 - smooth) * f / factor + smooth * f;
    }  // high frequencies unchanged
  }
}

double apply_yarn(const RopeScaling& s, double theta, int64_t dim, int64_t max_positions, std::vector<double>& inv) {
  const double original = static_cast<double>(s.original_max_position_embeddings);
  const double factor = s.factor ? *s.factor : static_cast<double>(max_positions) / original;
  double attention = 0;
  if (s.attention_factor) attention = *s.attention_factor;
  else if (s.mscale.value_or(0) != 0 && s.mscale_all_dim.value_or(0) != 0)
    attention = yarn_mscale(factor, *s.mscale) / yarn_mscale(factor, *s.mscale_all_dim);
  else attention = yarn_mscale(factor, 1.0);
  // transformers: `get("beta_fast") or 32` (0 and null both mean the default).
  const double beta_fast = s.beta_fast.value_or(0) != 0 ? *s.beta_fast : 32.0;
  const double beta_slow = s.beta_slow.value_or(0) != 0 ? *s.beta_slow : 1.0;
  // The dim index whose frequency turns `rotations` times over the original context.
  auto correction_dim = [&](double rotations) {
    return static_cast<double>(dim) * std::log(original / (rotations * kTwoPi)) / (2.0 * std::log(theta));
  };
  double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // as transformers: avoids a zero-width ramp
  for (size_t i = 0; i < inv.size(); ++i) {
    // ramp 0 -> extrapolated (original frequency), 1 -> interpolated (divided by factor).
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    inv[i] = inv[i] / factor * ramp + inv[i] * (1.0 - ramp);
  }
  return attention;
}
}  // namespace

const char* supported_rope_types() { return "default, linear, dynamic, llama3, yarn"; }

RopeFrequencies rope_frequencies(const RopeScaling& s, double theta, int64_t rotary_dim,
                                 int64_t max_position_embeddings, int64_t seq_len) {
  double base = theta;
  if (s.rope_type == "dynamic" && seq_len > max_position_embeddings) {
    KESTREL_CHECK(rotary_dim > 2, kComp, "rope_type 'dynamic' needs rotary_dim > 2, got ", rotary_dim);
    const double factor = required_factor(s);
    const double L = static_cast<double>(seq_len), M = static_cast<double>(max_position_embeddings);
    const double d = static_cast<double>(rotary_dim);
    base = theta * std::pow(factor * L / M - (factor - 1.0), d / (d - 2.0));
  }
  RopeFrequencies f = RopeFrequencies::standard(base, rotary_dim);
  if (s.rope_type == "default" || s.rope_type == "dynamic") return f;
  if (s.rope_type == "linear") {
    const double factor = required_factor(s);
    for (double& v : f.inv_freq) v /= factor;
  } else if (s.rope_type == "llama3") {
    apply_llama3(s, f.inv_freq);
  } else if (s.rope_type == "yarn") {
    f.attention_scaling = apply_yarn(s, theta, rotary_dim, max_position_embeddings, f.inv_freq);
  } else {
    throw make_error(kComp, "rope_type '", s.rope_type, "' is not supported; supported: ", supported_rope_types());
  }
  return f;
}

}  // namespace kestrel::models
