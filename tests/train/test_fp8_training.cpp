// FP8 training on the CPU (issue 23; kestrel/ops/fp8.h emulated exactly): the "fp8" config block
// (typed, unknown keys and tile-wise scaling refused by name, the 1.5B example config), the decoder's
// projections recording every role's amax, the tiled MLP refused, a recompute run equal bit for bit
// to the plain one (re-running the forward records the same amax and casts with the same scales), and a
// tiny decoder whose FP8 losses follow the f32 run's. Also: evaluation/sampling cadence leaves the
// training losses bit for bit alone, resume restores the FP8 state bit-exactly (and refuses one that
// does not fit; with data parallelism too, the ranks' amax reduced to one state), a skipped step does not roll, "auto" MLP tiling stays untiled, enable_fp8's refusals.
#include <gtest/gtest.h>

#include <filesystem>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "kestrel/autograd/tape.h"
#include "kestrel/models/safetensors.h"
#include "kestrel/train/memory_plan.h"
#include "kestrel/models/decoder.h"
#include "kestrel/ops/reduce.h"
#include "kestrel/train/run_config.h"
#include "kestrel/train/train_config.h"
#include "kestrel/train/trainer.h"
#include "support/errors.h"
#include "support/numerics.h"
#include "data_parallel_fixtures.h"
#include "trainer_fixtures.h"

namespace kestrel::train {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;
using kestrel::testing::error_of;
using kestrel::testing::expect_has;

std::string fp8_tmp(const std::string& n) { return testing::fresh_temp_dir("kestrel_fp8", n); }

const json kText = {{"model_type", "llama"}, {"vocab_size", 64}, {"hidden_size", 32}, {"intermediate_size", 64},
                    {"num_hidden_layers", 2}, {"num_attention_heads", 2}, {"num_key_value_heads", 1}};

TEST(Fp8Config, OffByDefaultTypedAndRefusedByName) {
  json cfg = default_train_config();
  EXPECT_FALSE(RunConfig::resolve(cfg).fp8);
  apply_override(cfg, "fp8.enabled=true");
  apply_override(cfg, "fp8.grad_format=e5m2");  // the trainer's defaults: e4m3, history 1
  apply_override(cfg, "fp8.amax_history=4");
  apply_override(cfg, "fp8.margin=2");
  apply_override(cfg, "device=cpu");
  RunConfig r = RunConfig::resolve(cfg);
  EXPECT_TRUE(r.fp8);
  EXPECT_EQ(r.fp8_recipe.grad_format, Fp8Format::E5M2);
  EXPECT_EQ(r.fp8_recipe.amax_history, 4);
  EXPECT_EQ(r.fp8_recipe.margin, 2);
  EXPECT_TRUE(r.fp8_recipe.fast_accum_forward);
  EXPECT_TRUE(r.fp8_fused_casts);
  apply_override(cfg, "fp8.fused_casts=false");
  EXPECT_FALSE(RunConfig::resolve(cfg).fp8_fused_casts);
  expect_has(error_of([] { resolve_train_config({{"fp8", {{"fused_casts", 1}}}}, "run.json"); }),
             {"run.json", "fused_casts", "boolean"});
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
  EXPECT_EQ(ex.fp8_recipe.grad_format, Fp8Format::E4M3);  // the recipe of the quality A/B (bench/RESULTS.md)
  EXPECT_EQ(ex.fp8_recipe.amax_history, 1);
  EXPECT_TRUE(ex.fp8_recipe.fast_accum_forward);
  // The 9B example (bench/RESULTS.md: 11,036 tok/s on the H200): the unconstrained step config with FP8 on.
  const fs::path nine = fs::path(__FILE__).parent_path() / ".." / ".." / "configs" / "llama_9b_250k_8k_step_fp8.json";
  std::ifstream g(nine);
  ASSERT_TRUE(g.good()) << nine;
  const RunConfig ex9 = RunConfig::resolve(resolve_train_config(json::parse(g), nine.string()));
  EXPECT_TRUE(ex9.fp8);
  EXPECT_EQ(ex9.fp8_recipe.grad_format, Fp8Format::E4M3);
  EXPECT_EQ(ex9.fp8_recipe.amax_history, 1);
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
  const std::string dir = fp8_tmp("recompute");
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
  // The input casts written by linear_fp8 instead of the norms and SwiGLU: the same bits.
  cfg["fp8"]["fused_casts"] = false;
  EXPECT_EQ(run_losses(cfg, dir + "/unfused"), rec);
  // ... and FP8 did run: the same run without it gives other losses.
  cfg["fp8"]["enabled"] = false;
  cfg["recompute"] = "none";
  const std::vector<double> off = run_losses(cfg, dir + "/off");
  ASSERT_EQ(off.size(), 4u);
  EXPECT_NE(plain, off);
  fs::remove_all(dir);
}

// Evaluation and sampling run forwards through the FP8 projections; their amax must not reach
// training's scales, so how often they run leaves the training losses bit for bit the same.
TEST(Fp8Training, EvaluationCadenceLeavesTheTrainingLossesAlone) {
  const std::string dir = fp8_tmp("eval_cadence");
  auto cfg_for = [&](int64_t every) {
    json cfg = testing::tiny_vlm_run(dir + "/e" + std::to_string(every), {{"steps", 5}, {"batch_size", 2}},
                                     {{"eval_every", every}, {"sample_every", every}, {"sample_count", 2},
                                      {"mlp_tile_tokens", 0}});
    cfg["fp8"]["enabled"] = true;
    return cfg;
  };
  const std::vector<double> none = run_losses(cfg_for(0), dir + "/e0");
  const std::vector<double> each = run_losses(cfg_for(1), dir + "/e1");
  const std::vector<double> second = run_losses(cfg_for(2), dir + "/e2");
  ASSERT_EQ(none.size(), 5u);
  EXPECT_EQ(none, each);
  EXPECT_EQ(none, second);
  fs::remove_all(dir);
}

// Resume restores the FP8 scaling state (histories, scales, roll count) from the checkpoint: the
// resumed run's losses are the uninterrupted run's, bit for bit. A checkpoint whose state does not fit
// the model's linears (another amax_history) is refused.
TEST(Fp8Training, ResumeIsBitExactAndRefusesAMismatchedState) {
  const std::string dir = fp8_tmp("resume");
  json cfg = testing::tiny_decoder_run(dir, kText, 64, 9, 16, 4, "cpu");
  cfg["train"]["steps"] = 5;
  cfg["fp8"]["enabled"] = true;
  cfg["mlp_tile_tokens"] = 0;
  cfg["checkpoint_every"] = 2;
  cfg["keep_checkpoints"] = 0;
  cfg["prefetch"] = 0;
  const std::vector<double> whole = run_losses(cfg, dir + "/a");
  ASSERT_EQ(whole.size(), 5u);
  // The run again from its step-2 checkpoint (the later ones removed).
  fs::copy(dir + "/a", dir + "/b", fs::copy_options::recursive);
  fs::remove_all(dir + "/b/checkpoints/step_00000004");
  fs::remove_all(dir + "/b/checkpoints/step_00000005");
  ASSERT_TRUE(fs::exists(dir + "/b/checkpoints/step_00000002/fp8_state.safetensors"));
  std::vector<std::string> lines;
  {
    json b = cfg;
    b["out_dir"] = dir + "/b";
    Trainer t(b);
    t.set_log_callback([&](const std::string& l) { lines.push_back(l); });
    t.resume("latest");
    t.run();
  }
  EXPECT_EQ(testing::metric_losses(dir + "/b"), whole);
  for (const std::string& l : lines) EXPECT_EQ(l.find("not bit-exact"), std::string::npos) << l;
  // Another amax history length (allowed as a config change) does not fit the saved state.
  json c = cfg;
  c["out_dir"] = dir + "/c";
  c["fp8"]["amax_history"] = 4;
  Trainer t(c);
  t.set_log_callback([](const std::string&) {});
  ResumeOptions allow;
  allow.allow_config_change = true;
  expect_has(error_of([&] { t.resume(dir + "/a/checkpoints/step_00000002", allow); }),
             {"fp8_state.safetensors", "does not fit", "amax_history 4"});
  // A checkpoint without FP8 state (written with fp8 off) resumes with fp8 on, saying it is not bit-exact.
  json off = cfg;
  off["fp8"]["enabled"] = false;
  off["train"]["steps"] = 2;
  run_losses(off, dir + "/d");
  ASSERT_FALSE(fs::exists(dir + "/d/checkpoints/step_00000002/fp8_state.safetensors"));
  json e = cfg;
  e["out_dir"] = dir + "/e";
  Trainer te(e);
  bool warned = false;
  te.set_log_callback([&](const std::string& l) {
    warned = warned || (l.find("no FP8 scaling state") != std::string::npos && l.find("not bit-exact") != std::string::npos);
  });
  te.resume(dir + "/d/checkpoints/step_00000002", allow);
  EXPECT_TRUE(warned);
  fs::remove_all(dir);
}

// Data parallelism: each rank casts its own slice of the batch, so the ranks' amax differ; the trainer
// reduces them (max) over the group before every roll, so all ranks hold one FP8 state and rank 0's
// checkpoint of it is every rank's. Two ranks resumed from the step-2 checkpoint end with the
// uninterrupted run's parameters and losses bit for bit (had rank 1 kept its own amax, it would resume
// with rank 0's scales instead of its own, and its casts, so the averaged gradients, would differ).
TEST(Fp8Training, DataParallelRanksShareOneStateSoResumeIsBitExact) {
  const std::string dir = fp8_tmp("dp");
  json cfg = testing::dp_run(dir, 4, 1);
  cfg["fp8"]["enabled"] = true;
  cfg["mlp_tile_tokens"] = 0;
  cfg["checkpoint_every"] = 2;
  cfg["keep_checkpoints"] = 0;
  cfg["out_dir"] = dir + "/a";
  for (const std::string& e : testing::run_group(cfg, 2, std::chrono::seconds(60))) ASSERT_EQ(e, "");
  const std::vector<double> whole = testing::metric_losses(dir + "/a");
  ASSERT_EQ(whole.size(), 4u);
  const std::string step2 = dir + "/a/checkpoints/step_00000002";
  ASSERT_TRUE(fs::exists(step2 + "/fp8_state.safetensors"));
  json b = cfg;
  b["out_dir"] = dir + "/b";
  const auto errors = testing::run_group(b, 2, std::chrono::seconds(60), [&](int, Trainer& t) {
    t.resume(step2);
    t.run();
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");
  EXPECT_TRUE(testing::final_parameters(dir + "/b") == testing::final_parameters(dir + "/a"))
      << "the resumed run's parameters differ from the uninterrupted run's";
  const std::vector<double> resumed = testing::metric_losses(dir + "/b");
  ASSERT_GE(resumed.size(), 2u);
  EXPECT_EQ(std::vector<double>(resumed.end() - 2, resumed.end()), std::vector<double>(whole.end() - 2, whole.end()));
  fs::remove_all(dir);
}

// A step skipped by train.nonfinite "skip" drops its amax: the FP8 state rolls only for applied steps
// (lr 1e30 blows the weights up in step 1, so steps 2 and 3 are not finite and skipped).
TEST(Fp8Training, ASkippedStepDoesNotRollTheScales) {
  const std::string dir = fp8_tmp("skip");
  json cfg = testing::tiny_decoder_run(dir, kText, 64, 9, 16, 4, "cpu");
  cfg["train"]["steps"] = 3;
  cfg["train"]["lr"] = 1e30;
  cfg["train"]["min_lr"] = 1e29;
  cfg["train"]["warmup_steps"] = 0;
  cfg["train"]["nonfinite"] = "skip";
  cfg["fp8"]["enabled"] = true;
  cfg["mlp_tile_tokens"] = 0;
  cfg["checkpoint_every"] = 3;
  cfg["out_dir"] = dir + "/out";
  int skipped = 0;
  {
    Trainer t(cfg);
    t.set_log_callback([&](const std::string& l) { skipped += l.find("update was skipped") != std::string::npos; });
    t.run();
  }
  ASSERT_EQ(skipped, 2);
  models::SafetensorsReader r =
      models::SafetensorsReader::open(dir + "/out/checkpoints/step_00000003/fp8_state.safetensors");
  const models::SafetensorsEntry& rolls = r.get("rolls");
  int64_t n = -1;
  std::memcpy(&n, rolls.bytes.data(), sizeof n);
  EXPECT_EQ(n, 1);  // step 1 only
  // The history holds step 1's amax and nothing after it.
  const models::SafetensorsEntry& h = r.get("history");
  const int64_t H = h.shape[1];
  std::vector<float> hist(static_cast<size_t>(h.shape[0] * H));
  std::memcpy(hist.data(), h.bytes.data(), hist.size() * sizeof(float));
  for (int64_t row = 0; row < h.shape[0]; ++row)
    for (int64_t j = 1; j < H; ++j) EXPECT_EQ(hist[row * H + j], 0.0f) << row << " " << j;
  fs::remove_all(dir);
}

// fp8 with mlp_tile_tokens "auto": the planner never picks a tile (the decoder refuses one with FP8).
TEST(Fp8Training, AutoMlpTileStaysUntiledWithFp8) {
  const fs::path example = fs::path(__FILE__).parent_path() / ".." / ".." / "configs" / "llama_1b5_8k_selective_fp8.json";
  std::ifstream f(example);
  ASSERT_TRUE(f.good()) << example;
  json cfg = resolve_train_config(json::parse(f), example.string());
  cfg["mlp_tile_tokens"] = "auto";
  cfg["fp8"]["enabled"] = false;
  json untiled = cfg;
  untiled["mlp_tile_tokens"] = 0;
  MemoryPlan p = plan_memory(untiled);
  // A budget the untiled MLP just fits (less than 10% to spare): auto tiles without fp8 ...
  cfg["memory_budget"] = std::to_string(p.peak + p.external + 4096);
  ASSERT_GT(choose_mlp_tile_tokens(cfg), 0);
  // ... and stays untiled with it.
  cfg["fp8"]["enabled"] = true;
  EXPECT_EQ(choose_mlp_tile_tokens(cfg), 0);
}

// enable_fp8 refuses what it cannot run, naming the field: a dtype/device pair without FP8 GEMMs,
// projection dims that are not multiples of 16, and a second call.
TEST(Fp8Decoder, EnableRefusesUnsupportedModelsAndASecondCall) {
  auto refused = [](json text, DType dt) {
    models::Decoder dec(models::TextConfig::from_json(text), dt, Device::cpu(), 3);
    return error_of([&] { dec.enable_fp8(Fp8Recipe{}); });
  };
  expect_has(refused(kText, DType::F16), {"fp8", "bf16", "f16"});
  json t = kText;
  t["hidden_size"] = 40;  // heads of 20
  expect_has(refused(t, DType::F32), {"hidden_size", "multiple of 16", "40"});
  t = kText;
  t["num_attention_heads"] = 4;  // head_dim 8: q 32 wide, k/v 8
  expect_has(refused(t, DType::F32), {"num_key_value_heads * head_dim", "8"});
  t = kText;
  t["intermediate_size"] = 72;
  expect_has(refused(t, DType::F32), {"intermediate_size", "72"});
  t = kText;
  t["head_dim"] = 12;  // q 24 wide
  t["num_key_value_heads"] = 2;
  expect_has(refused(t, DType::F32), {"num_attention_heads * head_dim", "24"});
  models::Decoder dec(models::TextConfig::from_json(kText), DType::F32, Device::cpu(), 3);
  dec.enable_fp8(Fp8Recipe{});
  expect_has(error_of([&] { dec.enable_fp8(Fp8Recipe{}); }), {"enable_fp8", "already"});
  models::Decoder bf(models::TextConfig::from_json(kText), DType::BF16, Device::cpu(), 3);
  bf.enable_fp8(Fp8Recipe{});  // bf16 on the CPU: supported
}

TEST(Fp8Training, TinyDecoderLossFollowsTheF32Run) {
  const std::string dir = fp8_tmp("follow");
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
