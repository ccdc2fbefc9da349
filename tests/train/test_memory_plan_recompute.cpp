// Recompute settings in the planner and the trainer: "selective" planned against profiled runs
// (the same 10% bar as the other plan-vs-profile cases; named MatchesProfileOn* so the ASan run
// leaves them out with the others, tools/sanitize.sh), the bytes per token per layer each setting
// keeps at the 1.5B shape, the "auto" choice against the costs table, the config's names, and a
// selective run training bit for bit like one without recompute.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "kestrel/models/config.h"
#include "kestrel/train/memory_plan.h"
#include "kestrel/train/memory_profile.h"
#include "kestrel/train/run_config.h"
#include "kestrel/train/train_config.h"
#include "kestrel/train/trainer.h"
#include "trainer_fixtures.h"
#include "support/temp_dir.h"

namespace kestrel::train {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

using kestrel::testing::source_dir;

json config_file(const std::string& name) {
  return resolve_train_config(models::read_json_file(source_dir() + "/configs/" + name, "config"), name);
}

void expect_plan_matches(const json& cfg, const std::string& what) {
  PlanOptions po;
  po.steps = cfg["train"]["steps"];
  MemoryPlan plan = plan_memory(cfg, po);
  MemoryProfile p = testing::profile_trainer_run(cfg, Device::cpu());
  for (MemoryTag t : {MemoryTag::Parameter, MemoryTag::Gradient, MemoryTag::OptimizerState, MemoryTag::Activation}) {
    const double measured = static_cast<double>(p.tag_peak[static_cast<int>(t)]);
    const double planned = static_cast<double>(plan.tag_peak[static_cast<int>(t)]);
    ASSERT_GT(measured, 0) << what << " " << tag_name(t);
    EXPECT_NEAR(planned / measured, 1.0, 0.10) << what << " " << tag_name(t) << ": planned " << planned
                                                << ", measured " << measured;
  }
  EXPECT_NEAR(static_cast<double>(plan.peak) / static_cast<double>(p.peak_in_use), 1.0, 0.10)
      << what << " total: planned " << plan.peak << " (" << plan.peak_where << "), measured " << p.peak_in_use << " ("
      << p.peak_phase << ")";
}

TEST(MemoryPlan, MatchesProfileOnDecoderTokensSelective) {
  std::string dir = testing::fresh_temp_dir("kestrel_mem_sel", "decoder");
  json text = {{"model_type", "llama"}, {"vocab_size", 96}, {"hidden_size", 64}, {"intermediate_size", 160},
               {"num_hidden_layers", 3}, {"num_attention_heads", 8}, {"num_key_value_heads", 2},
               {"tie_word_embeddings", false}};
  json cfg = testing::tiny_decoder_run(dir, text, 300, 11, /*seq_len=*/128, /*batch=*/4, "cpu");
  cfg["recompute"] = "selective";
  expect_plan_matches(cfg, "decoder selective");
  cfg["recompute"] = "selective+offload";  // the CPU keeps offloaded bytes in place: as selective
  expect_plan_matches(cfg, "decoder selective+offload");
  cfg["recompute"] = "selective";
  cfg["precision"] = "bf16";
  cfg["mlp_tile_tokens"] = 96;
  expect_plan_matches(cfg, "decoder selective bf16, MLP tiles of 96");
  fs::remove_all(dir);
}

TEST(MemoryPlan, MatchesProfileOnQuickstartSelective) {
  std::string dir = testing::fresh_temp_dir("kestrel_mem_sel", "vlm");
  json cfg = config_file("quickstart_vlm.json");
  cfg["train"]["steps"] = 2;
  cfg["out_dir"] = dir;
  cfg["device"] = "cpu";
  cfg["log_every"] = 1000;
  cfg["recompute"] = "selective";
  expect_plan_matches(cfg, "quickstart selective");
  fs::remove_all(dir);
}

// The 1.5B Llama at 8k tokens (configs/llama_1b5_8k.json: hidden 2048, 32 query / 8 KV heads of 64,
// MLP 8192, bf16): what a layer keeps per token. none: the norm outputs and statistics, q, k, v,
// attention out and lse, the MLP's three [T, 8192] activations and the output; full: the input;
// selective: the input, attention out (32 x 64 bf16) and lse (32 f32).
TEST(MemoryPlan, BytesPerTokenPerLayerAtTheOneAndAHalfBShape) {
  json cfg = config_file("llama_1b5_8k.json");
  auto per_token = [&](const char* recompute) {
    json c = cfg;
    c["recompute"] = recompute;
    c["mlp_tile_tokens"] = 0;
    return plan_memory(c).layer_bytes_per_token;
  };
  EXPECT_EQ(per_token("recompute"), 2048 * 2);
  EXPECT_EQ(per_token("selective"), 2048 * 2 + 32 * 64 * 2 + 32 * 4);  // 8320
  EXPECT_EQ(per_token("selective+offload"), 8320);                     // on the host
  // norm y + rstd, rope(q), k and v, attention out + lse, add_rms_norm y and h + rstd, gate, up and
  // swiglu, the output: 9.1x selective, 18.5x full.
  EXPECT_EQ(per_token("none"), 2048 * 2 + 4 + 2048 * 2 + 2 * 512 * 2 + 2048 * 2 + 32 * 4 + 2 * 2048 * 2 + 4 +
                                   3 * 8192 * 2 + 2048 * 2);  // 75912
  // The selective config file differs from llama_1b5_8k.json in the recompute setting only.
  json sel = config_file("llama_1b5_8k_selective.json");
  EXPECT_EQ(sel["recompute"], "selective");
  sel["recompute"] = cfg["recompute"];
  sel["out_dir"] = cfg["out_dir"];
  EXPECT_EQ(sel, cfg);
}

// The cuDNN attention backend's backward workspace is not known without the device: the planner,
// and through it the "auto" choices of a budgeted run, refuse it by name instead of guessing.
TEST(MemoryPlan, RefusesTheCudnnAttentionBackend) {
  json cfg = config_file("llama_1b5_8k.json");
  cfg["mlp_tile_tokens"] = 0;
  cfg["attention"]["backend"] = "kestrel";
  const int64_t peak = plan_memory(cfg).peak;
  cfg["attention"]["backend"] = "auto";
  EXPECT_EQ(plan_memory(cfg).peak, peak);  // auto runs (and plans) Kestrel's kernels
  cfg["attention"]["backend"] = "cudnn";
  for (const char* recompute : {"selective", "auto"}) {
    cfg["recompute"] = recompute;
    try {
      plan_memory(cfg);
      ADD_FAILURE() << "planned attention.backend cudnn with recompute " << recompute;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("attention.backend \"cudnn\" is not modelled"), std::string::npos) << e.what();
    }
  }
}

TEST(MemoryPlan, AutoRecomputeTakesTheFastestThatFits) {
  json cfg = config_file("llama_1b5_8k.json");
  cfg["recompute"] = "auto";
  cfg["mlp_tile_tokens"] = 0;
  EXPECT_EQ(choose_recompute(cfg), "none");  // no budget
  // At 8k tokens the peak comes in layer 0's backward, when every other layer's kept tensors are
  // gone and the gradients are nearly complete: selective costs nothing over full there.
  std::vector<RecomputeCost> costs = recompute_costs(cfg);
  ASSERT_EQ(costs.size(), 5u);  // CUDA: the offload settings too
  EXPECT_GT(costs[0].peak, costs[1].peak);
  EXPECT_EQ(costs[1].peak, costs[2].peak);
  // At 32k tokens activations decide it: the peak is in the top layer's backward, where selective
  // holds the 15 other layers' out + lse (132 MiB each) more than full.
  cfg["data"]["seq_len"] = 32768;
  costs = recompute_costs(cfg);
  ASSERT_EQ(costs.size(), 5u);
  const std::vector<std::string> names = {"none", "selective", "recompute", "selective+offload", "offload"};
  for (size_t i = 0; i < names.size(); ++i) EXPECT_EQ(costs[i].name, names[i]);
  for (size_t i = 0; i + 1 < costs.size(); ++i) EXPECT_GT(costs[i].peak, costs[i + 1].peak) << costs[i].name;
  EXPECT_FALSE(costs[1].recomputes_attention);
  EXPECT_TRUE(costs[2].recomputes_attention);
  EXPECT_EQ(costs[1].peak - costs[2].peak, 15 * int64_t{32768} * (32 * 64 * 2 + 32 * 4));
  EXPECT_EQ(costs[3].host_activations, 16 * int64_t{32768} * 8320);
  const int64_t external = plan_memory(cfg).external;
  // For each setting, a budget it fits with 10% to spare (and the faster ones do not) chooses it.
  for (size_t i = 0; i < costs.size(); ++i) {
    const int64_t need = costs[i].peak + external;
    cfg["memory_budget"] = std::to_string(need * 10 / 9 + 4096);
    EXPECT_EQ(choose_recompute(cfg), costs[i].name) << cfg["memory_budget"];
    EXPECT_EQ(plan_memory(cfg).recompute, costs[i].name + " (auto)");
  }
  cfg["memory_budget"] = "1GiB";  // nothing fits: the smallest footprint
  EXPECT_EQ(choose_recompute(cfg), "offload");
  EXPECT_NE(recompute_costs_table(recompute_costs(cfg), int64_t{1} << 30).find("selective+offload"), std::string::npos);
}

TEST(RunConfig, RecomputeSettings) {
  json cfg = resolve_train_config(json::object(), "test");
  auto resolve = [&](const char* v) {
    cfg["recompute"] = v;
    return RunConfig::resolve(cfg);
  };
  RunConfig r = resolve("selective");
  EXPECT_EQ(r.recompute, autograd::RecomputePolicy::Keep);
  EXPECT_TRUE(r.recompute_selective);
  EXPECT_EQ(r.recompute_name(), "selective");
  r = resolve("selective+offload");
  EXPECT_EQ(r.recompute, autograd::RecomputePolicy::Offload);
  EXPECT_TRUE(r.recompute_selective);
  EXPECT_EQ(r.recompute_name(), "selective+offload");
  r = resolve("full");
  EXPECT_EQ(r.recompute, autograd::RecomputePolicy::Keep);
  EXPECT_FALSE(r.recompute_selective);
  EXPECT_EQ(r.recompute_name(), "recompute");
  EXPECT_EQ(resolve("full+offload").recompute, autograd::RecomputePolicy::Offload);
  EXPECT_EQ(resolve("none").recompute_name(), "none");
  EXPECT_TRUE(resolve("auto").recompute_auto);
  try {
    resolve("sometimes");
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("selective+offload or auto, got 'sometimes'"), std::string::npos) << e.what();
  }
}

// The trainer with selective recompute: the same losses and parameters as without recompute, bit
// for bit (the CPU kernels are deterministic and the re-run reproduces every value).
TEST(Trainer, SelectiveRecomputeTrainsLikeNoRecompute) {
  std::string dir = testing::fresh_temp_dir("kestrel_sel", "train");
  json text = {{"model_type", "qwen2"}, {"vocab_size", 64}, {"hidden_size", 32}, {"intermediate_size", 48},
               {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
               {"tie_word_embeddings", true}};
  std::vector<std::vector<double>> losses;
  for (const char* recompute : {"none", "selective", "auto"}) {
    json cfg = testing::tiny_decoder_run(dir, text, 200, 7, /*seq_len=*/48, /*batch=*/3, "cpu");
    cfg["train"]["steps"] = 4;
    cfg["recompute"] = recompute;
    cfg["out_dir"] = dir + "/out_" + std::string(recompute);
    std::vector<std::string> lines;
    Trainer t(cfg);
    t.set_log_callback([&](const std::string& s) { lines.push_back(s); });
    t.run();
    losses.push_back(testing::metric_losses(cfg["out_dir"]));
    bool named = false;
    for (const std::string& l : lines) named |= l.find(std::string("recompute ") + (recompute == std::string("auto") ? "none" : recompute)) != std::string::npos;
    EXPECT_TRUE(named) << recompute;
  }
  ASSERT_EQ(losses[0].size(), 4u);
  EXPECT_EQ(losses[1], losses[0]);
  EXPECT_EQ(losses[2], losses[0]);
  fs::remove_all(dir);
}

// train.loss_gradient: the loss head's gradients in the forward (for the seed handed to it) or in the
// backward (from the saved lse). On the CPU both run the same kernels, so the runs are bitwise equal:
// losses and gradient norms, untied (lm_head leaf) and tied, with accumulation (in-place adds).
TEST(Trainer, LossGradientInTheForwardTrainsLikeInTheBackward) {
  std::string dir = testing::fresh_temp_dir("kestrel_lossgrad", "train");
  for (bool tied : {false, true}) {
    json text = {{"model_type", "qwen2"}, {"vocab_size", 64}, {"hidden_size", 32}, {"intermediate_size", 48},
                 {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                 {"tie_word_embeddings", tied}};
    std::vector<std::vector<double>> losses, norms;
    for (const char* where : {"backward", "forward"}) {
      json cfg = testing::tiny_decoder_run(dir, text, 200, 7, /*seq_len=*/48, /*batch=*/3, "cpu");
      cfg["train"]["steps"] = 3;
      cfg["train"]["grad_accum"] = 2;
      cfg["train"]["loss_gradient"] = where;
      cfg["out_dir"] = dir + "/out_" + std::string(where) + (tied ? "_tied" : "");
      Trainer t(cfg);
      t.set_log_callback([](const std::string&) {});
      t.run();
      losses.push_back(testing::metric_losses(cfg["out_dir"]));
      std::vector<double> n;
      std::ifstream f(cfg["out_dir"].get<std::string>() + "/metrics.jsonl");
      for (std::string line; std::getline(f, line);) n.push_back(json::parse(line)["grad_norm"].get<double>());
      norms.push_back(n);
    }
    // The gradient norms of every step and the losses that the updates lead to.
    ASSERT_EQ(losses[0].size(), 3u);
    EXPECT_EQ(losses[1], losses[0]) << (tied ? "tied" : "untied");
    EXPECT_EQ(norms[1], norms[0]) << (tied ? "tied" : "untied");
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kestrel::train
