// Rotary scaling per rope_type against an independent float64 reference written here from
// transformers 5's modeling_rope_utils (_compute_*_parameters), the rope op with each table against a
// plain rotation and the finite-difference checker, config parsing of both spellings (rope_scaling,
// rope_parameters), the errors for what is not implemented, and a decoder gradient check with yarn.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <nlohmann/json.hpp>
#include <numbers>

#include "kestrel/models/config.h"
#include "kestrel/models/decoder.h"
#include "kestrel/models/rope_scaling.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/rope.h"
#include "kestrel/runtime/error.h"
#include "support/numerics.h"
#include "support/op_table.h"

namespace kestrel::models {
namespace {
using nlohmann::json;
constexpr double kPi = std::numbers::pi;

// ---- the reference: transformers' formulas, element by element, in f64 ----
struct Ref {
  std::vector<double> inv;
  double scaling = 1.0;
};

std::vector<double> ref_base(double base, int64_t dim) {
  std::vector<double> inv;
  for (int64_t k = 0; k < dim; k += 2) inv.push_back(1.0 / std::pow(base, static_cast<double>(k) / dim));
  return inv;
}

Ref ref_llama3(double base, int64_t dim, double factor, double low_ff, double high_ff, double old_len) {
  Ref r{ref_base(base, dim)};
  const double low_wl = old_len / low_ff, high_wl = old_len / high_ff;
  for (double& f : r.inv) {
    const double wl = 2 * kPi / f;
    const double scaled = wl > low_wl ? f / factor : f;
    const double smooth = (old_len / wl - low_ff) / (high_ff - low_ff);
    const bool medium = !(wl < high_wl) && !(wl > low_wl);
    f = medium ? (1 - smooth) * scaled / factor + smooth * scaled : scaled;
  }
  return r;
}

Ref ref_yarn(double base, int64_t dim, double factor, double original, std::optional<double> attention,
             std::optional<double> mscale, std::optional<double> mscale_all_dim, double beta_fast, double beta_slow,
             bool truncate) {
  auto get_mscale = [](double s, double m) { return s <= 1 ? 1.0 : 0.1 * m * std::log(s) + 1.0; };
  Ref r;
  if (attention) r.scaling = *attention;
  else if (mscale && mscale_all_dim && *mscale != 0 && *mscale_all_dim != 0)
    r.scaling = get_mscale(factor, *mscale) / get_mscale(factor, *mscale_all_dim);
  else r.scaling = get_mscale(factor, 1.0);
  auto corr = [&](double rot) { return dim * std::log(original / (rot * 2 * kPi)) / (2 * std::log(base)); };
  double lo = corr(beta_fast), hi = corr(beta_slow);
  if (truncate) lo = std::floor(lo), hi = std::ceil(hi);
  lo = std::max(lo, 0.0);
  hi = std::min(hi, static_cast<double>(dim - 1));
  if (lo == hi) hi += 0.001;
  for (int64_t k = 0; k < dim / 2; ++k) {
    const double pos_freq = std::pow(base, static_cast<double>(2 * k) / dim);
    const double ramp = std::min(1.0, std::max(0.0, (k - lo) / (hi - lo)));
    const double extrapolation_factor = 1 - ramp;
    r.inv.push_back(1 / (factor * pos_freq) * (1 - extrapolation_factor) + 1 / pos_freq * extrapolation_factor);
  }
  return r;
}

void expect_table(const RopeFrequencies& got, const Ref& want) {
  ASSERT_EQ(got.inv_freq.size(), want.inv.size());
  for (size_t i = 0; i < want.inv.size(); ++i)
    EXPECT_NEAR(got.inv_freq[i], want.inv[i], 1e-14 * want.inv[i] + 1e-300) << "frequency " << i;
  EXPECT_NEAR(got.attention_scaling, want.scaling, 1e-14);
}

TextConfig parse(const json& j) { return TextConfig::from_json(j, "test.json"); }

json llama(json extra) {
  json j = {{"model_type", "llama"}, {"hidden_size", 256}, {"num_attention_heads", 4}, {"max_position_embeddings", 4096}};
  j.update(extra);
  return j;
}

void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> needles) {
  try {
    fn();
    ADD_FAILURE() << "expected a kestrel::Error";
  } catch (const Error& e) {
    std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "missing '" << n << "' in: " << msg;
  }
}

// ---- tables ----

TEST(RopeScaling, DefaultAndLinear) {
  TextConfig d = parse(llama({{"rope_theta", 500000.0}}));
  expect_table(d.rope_frequencies(), Ref{ref_base(500000.0, 64)});
  Ref lin{ref_base(10000.0, 64)};
  for (double& f : lin.inv) f /= 4.0;
  expect_table(parse(llama({{"rope_scaling", {{"type", "linear"}, {"factor", 4.0}}}})).rope_frequencies(), lin);
  expect_table(parse(llama({{"rope_parameters", {{"rope_type", "linear"}, {"factor", 4}, {"rope_theta", 1e4}}}}))
                   .rope_frequencies(),
               lin);
}

TEST(RopeScaling, Llama3AllThreeBands) {
  // Llama-3.2-1B's parameters: theta 5e5, head_dim 64, factor 32, low 1, high 4, original 8192.
  json rp = {{"rope_type", "llama3"}, {"rope_theta", 500000.0}, {"factor", 32.0}, {"low_freq_factor", 1.0},
             {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  TextConfig t = parse(llama({{"hidden_size", 2048}, {"num_attention_heads", 32}, {"rope_parameters", rp}}));
  Ref want = ref_llama3(500000.0, 64, 32.0, 1.0, 4.0, 8192.0);
  expect_table(t.rope_frequencies(), want);
  // The table really has the three bands: unchanged, blended, divided by the factor.
  Ref base{ref_base(500000.0, 64)};
  int same = 0, divided = 0, blended = 0;
  for (size_t i = 0; i < base.inv.size(); ++i) {
    double ratio = base.inv[i] / want.inv[i];
    if (std::abs(ratio - 1) < 1e-12) ++same;
    else if (std::abs(ratio - 32) < 1e-9) ++divided;
    else ++blended;
  }
  EXPECT_GT(same, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(blended, 0);
  // The legacy spelling (rope_scaling + top-level rope_theta) gives the same table.
  json rs = rp;
  rs.erase("rope_theta");
  TextConfig legacy = parse(llama({{"hidden_size", 2048}, {"num_attention_heads", 32}, {"rope_theta", 500000.0},
                                   {"rope_scaling", rs}}));
  expect_table(legacy.rope_frequencies(), want);
}

TEST(RopeScaling, YarnDefaultsAndAttentionFactor) {
  // Qwen2.5's recommended long-context setting: factor 4 over 32768 positions, theta 1e6, head_dim 128.
  TextConfig t = parse({{"model_type", "qwen2"}, {"hidden_size", 1024}, {"num_attention_heads", 8},
                        {"num_key_value_heads", 2}, {"max_position_embeddings", 131072}, {"rope_theta", 1e6},
                        {"rope_scaling", {{"type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}}}});
  Ref want = ref_yarn(1e6, 128, 4.0, 32768, std::nullopt, std::nullopt, std::nullopt, 32, 1, true);
  expect_table(t.rope_frequencies(), want);
  EXPECT_NEAR(t.rope_frequencies().attention_scaling, 0.1 * std::log(4.0) + 1.0, 1e-15);
  // original_max_position_embeddings defaults to max_position_embeddings.
  TextConfig d = parse(llama({{"rope_scaling", {{"rope_type", "yarn"}, {"factor", 8.0}}}}));
  expect_table(d.rope_frequencies(), ref_yarn(1e4, 64, 8.0, 4096, std::nullopt, std::nullopt, std::nullopt, 32, 1, true));
}

TEST(RopeScaling, YarnMscaleBetasTruncateAndDerivedFactor) {
  // factor null: max_position_embeddings / original; mscale ratio; betas; no truncation.
  json rp = {{"rope_type", "yarn"},     {"rope_theta", 10000.0}, {"factor", nullptr},
             {"mscale", 0.707},         {"mscale_all_dim", 1.0}, {"beta_fast", 16},
             {"beta_slow", 2},          {"truncate", false},     {"original_max_position_embeddings", 512}};
  TextConfig t = parse(llama({{"rope_parameters", rp}}));
  expect_table(t.rope_frequencies(), ref_yarn(1e4, 64, 8.0, 512, std::nullopt, 0.707, 1.0, 16, 2, false));
  // An explicit attention_factor wins over everything else.
  rp["attention_factor"] = 0.9;
  rp["factor"] = 3.0;
  TextConfig a = parse(llama({{"rope_parameters", rp}}));
  expect_table(a.rope_frequencies(), ref_yarn(1e4, 64, 3.0, 512, 0.9, 0.707, 1.0, 16, 2, false));
  // A top-level original_max_position_embeddings wins over the dict's (Phi3-style configs).
  TextConfig top = parse(llama({{"rope_parameters", rp}, {"original_max_position_embeddings", 1024}}));
  expect_table(top.rope_frequencies(), ref_yarn(1e4, 64, 3.0, 1024, 0.9, 0.707, 1.0, 16, 2, false));
}

TEST(RopeScaling, DynamicIsDefaultUpToMaxAndRefusedPast) {
  TextConfig t = parse(llama({{"max_position_embeddings", 64}, {"rope_scaling", {{"rope_type", "dynamic"}, {"factor", 2.0}}}}));
  expect_table(t.rope_frequencies(64), Ref{ref_base(1e4, 64)});
  // transformers' NTK base for a longer sequence (the math is there; training on it is refused).
  const double base = 1e4 * std::pow(2.0 * 100 / 64 - 1.0, 64.0 / 62.0);
  expect_table(t.rope_frequencies(100), Ref{ref_base(base, 64)});
  EXPECT_NO_THROW(t.check_sequence_length(64));
  expect_error([&] { t.check_sequence_length(65); }, {"[rope]", "dynamic", "65", "max_position_embeddings (64)"});
}

TEST(RopeScaling, UnsupportedAndIncompleteAreErrors) {
  expect_error([] { parse(llama({{"rope_scaling", {{"rope_type", "longrope"}, {"factor", 2.0}}}})); },
               {"[config]", "test.json", "'rope_scaling.rope_type'", "longrope", "default, linear, dynamic, llama3, yarn"});
  expect_error([] { parse(llama({{"rope_parameters", {{"rope_type", "su"}}}})); },
               {"'rope_parameters.rope_type'", "'su'", "supported"});
  expect_error([] { parse(llama({{"rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0}}}})); },
               {"'rope_scaling.low_freq_factor'", "required", "llama3"});
  expect_error([] { parse(llama({{"rope_scaling", {{"rope_type", "linear"}}}})); },
               {"'rope_scaling.factor'", "required"});
  expect_error([] { parse(llama({{"rope_scaling", {{"rope_type", "linear"}, {"factor", "2"}}}})); },
               {"'rope_scaling.factor'", "number"});
  expect_error([] { parse(llama({{"rope_parameters", {{"rope_type", "default"}, {"partial_rotary_factor", 0.5}}}})); },
               {"'rope_parameters.partial_rotary_factor'", "not supported"});
  // A programmatic config is validated too.
  TextConfig t = TextConfig::defaults_for("llama");
  t.rope_scaling.rope_type = "ntk";
  expect_error([&] { t.validate("prog"); }, {"'rope_scaling.rope_type'", "ntk", "yarn"});
}

// Written back as rope_scaling and read again to the same table.
TEST(RopeScaling, RoundTripThroughToJson) {
  json rp = {{"rope_type", "yarn"}, {"rope_theta", 1e4}, {"factor", 4.0}, {"beta_fast", 8.0},
             {"original_max_position_embeddings", 256}, {"truncate", false}};
  TextConfig t = parse(llama({{"rope_parameters", rp}}));
  TextConfig back = parse(t.to_json());
  EXPECT_EQ(back.rope_frequencies().inv_freq, t.rope_frequencies().inv_freq);
  EXPECT_EQ(back.rope_frequencies().attention_scaling, t.rope_frequencies().attention_scaling);
  // A struct set in code (no raw JSON) is serialised from its fields.
  TextConfig prog = TextConfig::defaults_for("llama");
  prog.rope_scaling = t.rope_scaling;
  TextConfig prog_back = parse(prog.to_json());
  EXPECT_EQ(prog_back.rope_frequencies().inv_freq, prog.rope_frequencies().inv_freq);
}

// ---- the op with each table ----

Tensor rotate_reference(const Tensor& x, const Tensor& positions, const RopeFrequencies& f) {
  const int64_t T = x.shape()[0], H = x.shape()[1], D = x.shape()[2], half = f.rotary_dim() / 2;
  std::vector<double> xv = testing::host_values(x), pos = testing::host_values(positions), y = xv;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < half; ++i) {
        const double a = pos[t] * f.inv_freq[i], c = f.attention_scaling * std::cos(a),
                     s = f.attention_scaling * std::sin(a);
        const int64_t b = (t * H + h) * D;
        y[b + i] = xv[b + i] * c - xv[b + i + half] * s;
        y[b + i + half] = xv[b + i + half] * c + xv[b + i] * s;
      }
  return testing::f64_tensor(y, x.shape());
}

std::vector<std::pair<std::string, RopeFrequencies>> tables_for_op() {
  const json base = {{"hidden_size", 48}, {"num_attention_heads", 3}, {"max_position_embeddings", 64}};
  std::vector<std::pair<std::string, RopeFrequencies>> out;
  auto add = [&](const std::string& name, json rs) {
    json j = llama(base);
    if (!rs.is_null()) j["rope_scaling"] = rs;
    out.emplace_back(name, parse(j).rope_frequencies());
  };
  add("default", nullptr);
  add("linear", {{"rope_type", "linear"}, {"factor", 3.0}});
  add("llama3", {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                 {"original_max_position_embeddings", 16}});
  add("yarn", {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 16}});
  add("yarn_mscale", {{"rope_type", "yarn"}, {"factor", 4.0}, {"mscale", 0.8}, {"mscale_all_dim", 0.5},
                      {"original_max_position_embeddings", 16}, {"truncate", false}});
  return out;
}

TEST(RopeScaling, OpForwardMatchesRotationPerType) {
  for (auto& [name, f] : tables_for_op()) {
    SCOPED_TRACE(name);
    ASSERT_EQ(f.rotary_dim(), 16);
    std::vector<int64_t> pos;
    for (int64_t p = 0; p < 40; ++p) pos.push_back(p * 3);  // well past original_max_position_embeddings
    Tensor positions = Tensor::from_vector(pos, {40}, DType::I64);
    for (DType dt : {DType::F64, DType::F32}) {
      Tensor x = testing::randn({40, 3, 16}, dt);
      Tensor want = rotate_reference(x, positions, f);
      EXPECT_LT(testing::rel_l2(rope(x, positions, f), want), dt == DType::F64 ? 1e-13 : 1e-6);
    }
  }
}

TEST(RopeScaling, OpGradientsMatchFiniteDifferencesPerType) {
  for (auto& [name, f] : tables_for_op()) {
    SCOPED_TRACE(name);
    Tensor positions = Tensor::from_vector(std::vector<int64_t>{0, 5, 17, 33, 2, 60}, {6}, DType::I64);
    EXPECT_TRUE(testing::gradcheck([&, f = f](const std::vector<Tensor>& in) { return rope(in[0], positions, f); },
                                   {testing::randn({6, 2, 18}, DType::F64)}));
  }
}

TEST(RopeScaling, OpRejectsBadTables) {
  Tensor x = testing::randn({3, 1, 8});
  Tensor pos = Tensor::from_vector(std::vector<int64_t>{0, 1, 2}, {3}, DType::I64);
  expect_error([&] { rope(x, pos, RopeFrequencies::standard(1e4, 10)); }, {"[rope]", "rotary_dim=10", "<= D=8"});
  RopeFrequencies bad = RopeFrequencies::standard(1e4, 8);
  bad.inv_freq[1] = std::nan("");
  expect_error([&] { rope(x, pos, bad); }, {"[rope]", "finite"});
}

// ---- the decoder: yarn scaling (attention factor included) through the whole model in f64 ----

TEST(RopeScaling, DecoderGradientsWithYarnMatchFiniteDifferences) {
  TextConfig c = TextConfig::defaults_for("llama");
  c.vocab_size = 23;
  c.hidden_size = 16;
  c.intermediate_size = 20;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 8;
  c.max_position_embeddings = 16;
  c.rope_scaling.rope_type = "yarn";
  c.rope_scaling.factor = 4.0;
  c.rope_scaling.original_max_position_embeddings = 4;
  Decoder m(c, DType::F64, Device::cpu(), 3);
  ASSERT_GT(m.config().rope_frequencies().attention_scaling, 1.1);
  PackedBatch batch = PackedBatch::from_lengths({9, 3}, Device::cpu());
  Tensor ids = Tensor::from_vector(std::vector<int64_t>{1, 5, 9, 2, 20, 7, 7, 11, 3, 4, 8, 12}, {12});
  Tensor labels = Tensor::from_vector(std::vector<int64_t>{5, 9, 2, 20, 7, 7, 11, 3, -100, 8, 12, -100}, {12});
  std::vector<std::string> names = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                                    "model.layers.0.input_layernorm.weight"};
  std::vector<Tensor> inputs;
  for (auto& n : names) inputs.push_back(m.parameters().get(n).detach());
  EXPECT_TRUE(testing::gradcheck(
      [&](const std::vector<Tensor>& in) {
        for (size_t i = 0; i < names.size(); ++i) m.parameters().get(names[i]) = in[i];
        return m.loss(m.forward(m.embed(ids), batch), labels);
      },
      inputs, {.eps = 1e-6, .atol = 1e-8, .rtol = 1e-5}));
}

TEST(RopeScaling, DecoderRefusesDynamicPastMaxPositions) {
  TextConfig c = TextConfig::defaults_for("llama");
  c.vocab_size = 11;
  c.hidden_size = 8;
  c.intermediate_size = 8;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 2;
  c.head_dim = 4;
  c.max_position_embeddings = 6;
  c.rope_scaling.rope_type = "dynamic";
  c.rope_scaling.factor = 2.0;
  Decoder m(c, DType::F32, Device::cpu(), 1);
  Tensor ids = Tensor::from_vector(std::vector<int64_t>(7, 3), {7});
  Tensor ids6 = Tensor::from_vector(std::vector<int64_t>(6, 3), {6});
  EXPECT_NO_THROW(m.forward(m.embed(ids6), PackedBatch::from_lengths({6}, Device::cpu())));
  expect_error([&] { m.forward(m.embed(ids), PackedBatch::from_lengths({7}, Device::cpu())); },
               {"[rope]", "dynamic", "7 tokens"});
}

}  // namespace
}  // namespace kestrel::models
