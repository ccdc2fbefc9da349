// FP8 training on the CPU (issue 23; kestrel/ops/fp8.h emulated exactly): the "fp8" config block
// (typed, unknown keys and tile-wise scaling refused by name, the 1.5B example config), the decoder's
// projections recording every role's amax, the tiled MLP refused, a recompute run equal bit for bit
// to the plain one (re-running the forward records the same amax and casts with the same scales), and a
// tiny decoder whose FP8 losses follow the f32 run's.
#include <gtest/gtest.h>

#include <filesystem>
#include <cstdio>
#include <fstream>

#include "kestrel/autograd/tape.h"
#include "kestrel/models/decoder.h"
#include "kestrel/ops/reduce.h"
#include "kestrel/train/run_config.h"
#include "kestrel/train/train_config.h"
#include "kestrel/train/trainer.h"
#include "support/errors.h"
#include "support/numerics.h"
#include "trainer_fixtures.h"

namespace kestrel::train {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;
using kestrel::testing::error_of;
using kestrel::testing::expect_has;

std::string tmp(const std::string& n) { return testing::fresh_temp_dir("kestrel_fp8", n); }

const json kText = {{"model_type", "llama"}, {"vocab_size", 64}, {"hidden_size", 32}, {"intermediate_size", 64},
                    {"num_hidden_layers", 2}, {"num_attention_heads", 2}, {"num_key_value_heads", 1}};

TEST(Fp8Config, OffByDefaultTypedAndRefusedByName) {
  json cfg = default_train_config();
  EXPECT_FALSE(RunConfig::resolve(cfg).fp8);
  apply_override(cfg, "fp8.enabled=true");
  apply_override(cfg, "fp8.grad_format=e4m3");
  apply_override(cfg, "fp8.amax_history=4");
  apply_override(cfg, "fp8.margin=2");
  apply_override(cfg, "device=cpu");
  RunConfig r = RunConfig::resolve(cfg);
  EXPECT_TRUE(r.fp8);
  EXPECT_EQ(r.fp8_recipe.grad_format, Fp8Format::E4M3);
  EXPECT_EQ(r.fp8_recipe.amax_history, 4);
  EXPECT_EQ(r.fp8_recipe.margin, 2);
  EXPECT_TRUE(r.fp8_recipe.fast_accum_forward);
  expect_has(error_of([] { resolve_train_config({{"fp8", {{"enable", true}}}}, "run.json"); }),
             {"run.json", "fp8.enable", "valid keys"});
  expect_has(error_of([] { resolve_train_config({{"fp8", {{"amax_history", -1}}}}, "run.json"); }),
             {"fp8.amax_history"});
  auto resolved = [](const json& user) { return RunConfig::resolve(resolve_train_config(user, "run.json")); };
  expect_has(error_of([&] { resolved({{"fp8", {{"scaling", "tile"}}}}); }), {"fp8.scaling", "tile-wise", "not"});
  expect_has(error_of([&] { resolved({{"fp8", {{"grad_format", "e2m5"}}}}); }), {"fp8.grad_format", "e2m5"});
  expect_has(error_of([&] { resolved({{"fp8", {{"amax_history", 0}}}}); }), {"fp8.amax_history"});
  expect_has(error_of([&] { resolved({{"fp8", {{"enabled", true}}}, {"device", "cpu"}, {"precision", "f16"}}); }),
             {"fp8.enabled", "precision", "f16"});
  // The 1.5B example: the selective config with FP8 on.
  const fs::path example = fs::path(__FILE__).parent_path() / ".." / ".." / "configs" / "llama_1b5_8k_selective_fp8.json";
  std::ifstream f(example);
  ASSERT_TRUE(f.good()) << example;
  const RunConfig ex = RunConfig::resolve(resolve_train_config(json::parse(f), example.string()));
  EXPECT_TRUE(ex.fp8);
  EXPECT_TRUE(ex.recompute_selective);
  EXPECT_EQ(ex.fp8_recipe.grad_format, Fp8Format::E5M2);
}

TEST(Fp8Decoder, EveryProjectionRecordsItsAmaxAndTheTiledMlpIsRefused) {
  models::TextConfig tc = models::TextConfig::from_json(kText);
  for (const char* type : {"llama", "qwen2"}) {  // qwen2: q/k/v biases added after the FP8 GEMM
    json text = kText;
    text["model_type"] = type;
    models::Decoder dec(models::TextConfig::from_json(text), DType::F32, Device::cpu(), 3);
    dec.enable_fp8(Fp8Recipe{});
    ASSERT_NE(dec.fp8_state(), nullptr);
    EXPECT_EQ(dec.fp8_state()->linears(), 2 * models::Decoder::kFp8LinearsPerLayer);
    std::vector<int64_t> ids(24);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>((i * 5 + 1) % 64);
    models::PackedBatch batch = models::PackedBatch::from_lengths({24}, Device::cpu());
    Tensor h = dec.forward(dec.embed(Tensor::from_vector(ids, {24}, DType::I64)), batch);
    autograd::backward({sum(h, {0, 1})}, {});
    // Rows are role-major (input, weight, gradient) over linears l * 7 + {q k v o gate up down}; k, v
    // and up read the input cast of q and gate, so their input rows stay unused.
    const std::vector<float> amax = dec.fp8_state()->amax().to_float_vector();
    const int64_t L = dec.fp8_state()->linears();
    for (int64_t r = 0; r < 3 * L; ++r) {
      const int64_t j = (r % L) % models::Decoder::kFp8LinearsPerLayer;
      const bool shared_input = r < L && (j == 1 || j == 2 || j == 5);
      if (shared_input)
        EXPECT_EQ(amax[r], 0.0f) << type << " row " << r;
      else
        EXPECT_GT(amax[r], 0.0f) << type << " row " << r;
    }
    for (auto& [name, p] : dec.parameters().items())
      if (name.find("layers.") != std::string::npos) EXPECT_TRUE(p->grad().defined()) << type << " " << name;
    if (std::string(type) == "qwen2") EXPECT_TRUE(dec.parameters().get("model.layers.0.self_attn.q_proj.bias").grad().defined());
  }
  models::Decoder dec(tc, DType::F32, Device::cpu(), 3);
  dec.enable_fp8(Fp8Recipe{});
  expect_has(error_of([&] { dec.set_mlp_tile_tokens(8); }), {"fp8", "tiled MLP"});
  models::Decoder tiled(tc, DType::F32, Device::cpu(), 3);
  tiled.set_mlp_tile_tokens(8);
  expect_has(error_of([&] { tiled.enable_fp8(Fp8Recipe{}); }), {"fp8", "tiled MLP"});
}

std::vector<double> run_losses(json cfg, const std::string& out) {
  cfg["out_dir"] = out;
  {
    Trainer t(cfg);
    t.set_log_callback([](const std::string&) {});
    t.run();
  }
  return testing::metric_losses(out);
}

TEST(Fp8Training, RecomputeRunEqualsThePlainRunBitForBit) {
  const std::string dir = tmp("recompute");
  json cfg = testing::tiny_decoder_run(dir, kText, 64, 9, 16, 4, "cpu");
  cfg["train"]["steps"] = 4;
  cfg["train"]["grad_accum"] = 2;
  cfg["fp8"]["enabled"] = true;
  cfg["mlp_tile_tokens"] = 0;
  const std::vector<double> plain = run_losses(cfg, dir + "/plain");
  cfg["recompute"] = "full";
  const std::vector<double> rec = run_losses(cfg, dir + "/rec");
  ASSERT_EQ(plain.size(), 4u);
  EXPECT_EQ(plain, rec);
  fs::remove_all(dir);
}

TEST(Fp8Training, TinyDecoderLossFollowsTheF32Run) {
  const std::string dir = tmp("follow");
  json cfg = testing::tiny_decoder_run(dir, kText, 200, 9, 16, 4, "cpu");
  cfg["train"]["steps"] = 40;
  cfg["train"]["lr"] = 1e-2;
  cfg["train"]["warmup_steps"] = 4;
  cfg["mlp_tile_tokens"] = 0;
  const std::vector<double> ref = run_losses(cfg, dir + "/f32");
  cfg["fp8"]["enabled"] = true;
  const std::vector<double> fp8 = run_losses(cfg, dir + "/fp8");
  ASSERT_EQ(ref.size(), 40u);
  ASSERT_EQ(fp8.size(), 40u);
  auto mean_last = [](const std::vector<double>& v) {
    double s = 0;
    for (size_t i = v.size() - 5; i < v.size(); ++i) s += v[i];
    return s / 5;
  };
  // It learns (the loss falls well below its start) and tracks the f32 run within a few percent.
  EXPECT_LT(mean_last(fp8), 0.7 * fp8[0]);
  EXPECT_NEAR(mean_last(fp8), mean_last(ref), 0.05 * mean_last(ref));
  // ... and it is a different computation (quantised), not the f32 run again.
  EXPECT_NE(fp8, ref);
  for (size_t i = 0; i < ref.size(); i += 13) std::printf("step %zu: f32 %.4f fp8 %.4f\n", i + 1, ref[i], fp8[i]);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kestrel::train
