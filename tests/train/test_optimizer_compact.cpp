// The compact optimizer modes of issue 21 through the AdamW class, the trainer and the planner:
// q8 moments offloaded to the host equal q8 moments beside the parameters bit for bit; the update
// inside backward equals the update after it bit for bit and leaves no gradient behind; the trainer
// refuses contradictory configs naming the keys; a compact run tracks an exact one; the planner
// counts bytes per parameter for each mode.
#include <gtest/gtest.h>

#include <cmath>

#include "adamw_compact_check.h"
#include "kestrel/runtime/error.h"
#include "kestrel/train/memory_plan.h"
#include "trainer_fixtures.h"
#include "support/errors.h"

namespace kestrel::train {
namespace {

using testing::fresh_temp_dir;
using testing::metric_losses;
using testing::tiny_decoder_run;

TEST(AdamWCompact, Q8HostOffloadMatchesDeviceBitForBit) {
  for (DType dtype : {DType::BF16, DType::F32})
    testing::expect_q8_offload_matches_device(Device::cpu(), dtype, {{5000}, {3, 2049}, {300, 700}, {7}}, {});
}

TEST(AdamWCompact, StepInBackwardEqualsStepAfterBackward) {
  testing::expect_step_in_backward_matches_step_after(Device::cpu(), {{4099}, {17, 33}, {5}}, {});
}

nlohmann::json tiny_text() {
  return {{"model_type", "llama"}, {"vocab_size", 67}, {"hidden_size", 32}, {"intermediate_size", 48},
          {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
          {"tie_word_embeddings", false}};
}

using kestrel::testing::error_of;

TEST(AdamWCompact, TrainerRefusesContradictoryConfigsNamingTheKeys) {
  const std::string dir = fresh_temp_dir("kestrel_compact", "refuse");
  nlohmann::json base = tiny_decoder_run(dir, tiny_text(), 16, 5, 24, 2, "cpu");
  base["optimizer"]["step_in_backward"] = true;
  base["train"]["grad_clip"] = 0.0;
  auto with = [&](const std::string& key, const nlohmann::json& v) {
    nlohmann::json c = base;
    apply_override(c, key + "=" + v.dump());
    return c;
  };
  std::string e = error_of([&] { Trainer t(with("train.grad_accum", 2)); });
  EXPECT_NE(e.find("optimizer.step_in_backward"), std::string::npos) << e;
  EXPECT_NE(e.find("train.grad_accum=1"), std::string::npos) << e;
  e = error_of([&] { Trainer t(with("train.grad_clip", 1.0)); });
  EXPECT_NE(e.find("train.grad_clip=0"), std::string::npos) << e;
  e = error_of([&] { Trainer t(with("train.nonfinite", "skip")); });
  EXPECT_NE(e.find("train.nonfinite"), std::string::npos) << e;
  // master_weights "none" with the host offload of a CUDA run (no GPU needed to refuse it).
  nlohmann::json c = with("optimizer.master_weights", "none");
  c["optimizer"]["offload"] = "host";
  e = error_of([&] { optimizer_placement_from_config(c, Device::cuda(0)); });
  EXPECT_NE(e.find("optimizer.master_weights=\"none\" with optimizer.offload=\"host\""), std::string::npos) << e;
  e = error_of([&] { Trainer t(with("optimizer.master_weights", "fp8")); });
  EXPECT_NE(e.find("optimizer.master_weights must be"), std::string::npos) << e;
  e = error_of([&] { Trainer t(with("optimizer.state_dtype", "int4")); });
  EXPECT_NE(e.find("\"q8\""), std::string::npos) << e;
}

// The trainer end to end: the in-backward step gives the same losses as the step after backward, and
// the compact mode (bf16 without master, q8 moments, in backward) trains like exact AdamW: after 40
// steps on the tiny decoder its loss is within 3% of exact AdamW's (both drop by more than 30%).
TEST(AdamWCompact, TrainerCompactModeTracksExactAdamW) {
  const std::string dir = fresh_temp_dir("kestrel_compact", "trainer");
  auto run = [&](const std::string& name, const std::string& state, const std::string& master, bool inside) {
    nlohmann::json cfg = tiny_decoder_run(dir + "/" + name, tiny_text(), 64, 9, 24, 2, "cpu");
    cfg["train"]["steps"] = 40;
    cfg["train"]["grad_clip"] = 0.0;
    cfg["train"]["lr"] = 1e-2;
    cfg["train"]["warmup_steps"] = 2;
    cfg["precision"] = "bf16";
    cfg["optimizer"]["state_dtype"] = state;
    cfg["optimizer"]["master_weights"] = master;
    cfg["optimizer"]["step_in_backward"] = inside;
    Trainer t(cfg);
    t.set_log_callback([](const std::string&) {});
    t.run();
    return metric_losses(dir + "/" + name + "/out");
  };
  const std::vector<double> exact = run("exact", "f32", "f32", false);
  const std::vector<double> after = run("after", "q8", "none", false);
  const std::vector<double> inside = run("inside", "q8", "none", true);
  ASSERT_EQ(exact.size(), 40u);
  EXPECT_EQ(after, inside);
  EXPECT_LT(exact.back(), 0.7 * exact.front());
  std::printf("tiny decoder, 40 steps: exact AdamW %.4f -> %.4f, compact %.4f (%+.2f%%)\n", exact.front(), exact.back(),
              inside.back(), 100 * (inside.back() - exact.back()) / exact.back());
  EXPECT_LE(std::abs(inside.back() - exact.back()), 0.03 * exact.back());
}

// Checkpoints of the compact modes (q8 codes and scales, no master or a host master) resume exactly:
// 3 steps + resume + 3 steps = 6 steps straight, with tied embeddings (their hook fires last).
TEST(AdamWCompact, ResumeFromCheckpointsIsExact) {
  const std::string dir = fresh_temp_dir("kestrel_compact", "resume");
  nlohmann::json text = {{"model_type", "qwen2"}, {"vocab_size", 61}, {"hidden_size", 32}, {"intermediate_size", 40},
                         {"num_hidden_layers", 1}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                         {"tie_word_embeddings", true}};
  for (const char* mode : {"device", "host"}) {
    auto run_cfg = [&](const std::string& sub, int64_t steps) {
      nlohmann::json cfg = tiny_decoder_run(dir + "/" + mode + "_" + sub, text, 48, 7, 20, 2, "cpu");
      cfg["train"]["steps"] = steps;
      cfg["train"]["lr"] = 5e-3;
      cfg["train"]["grad_clip"] = 0.0;
      cfg["precision"] = "bf16";
      cfg["optimizer"]["state_dtype"] = "q8";
      cfg["optimizer"]["step_in_backward"] = true;
      cfg["optimizer"]["offload"] = std::string(mode) == "host" ? "host" : "none";
      cfg["optimizer"]["master_weights"] = std::string(mode) == "host" ? "f32" : "none";
      cfg["checkpoint_every"] = 3;
      return cfg;
    };
    for (auto [sub, steps] : {std::pair<const char*, int64_t>{"straight", 6}, {"resumed", 3}}) {
      Trainer t(run_cfg(sub, steps));
      t.set_log_callback([](const std::string&) {});
      t.run();
    }
    {
      Trainer t(run_cfg("resumed", 6));
      t.set_log_callback([](const std::string&) {});
      t.resume("latest");
      t.run();
    }
    const std::vector<double> a = metric_losses(dir + "/" + mode + "_straight/out"),
                              b = metric_losses(dir + "/" + mode + "_resumed/out");
    EXPECT_EQ(a.size(), 6u) << mode;
    EXPECT_EQ(a, b) << mode;
  }
}

// kestrel-mem plan: bytes per parameter of each mode, and the in-backward step's gradient peak.
TEST(AdamWCompact, PlannerModelsTheModes) {
  const std::string dir = fresh_temp_dir("kestrel_compact", "plan");
  nlohmann::json cfg = tiny_decoder_run(dir, tiny_text(), 16, 5, 24, 2, "cpu");
  cfg["precision"] = "bf16";
  cfg["train"]["grad_clip"] = 0.0;
  const MemoryPlan exact = plan_memory(cfg);
  EXPECT_EQ(exact.bytes_per_param_device_state, 12.0);  // f32 master + two f32 moments
  cfg["optimizer"]["state_dtype"] = "q8";
  cfg["optimizer"]["master_weights"] = "none";
  const MemoryPlan q8 = plan_memory(cfg);
  EXPECT_DOUBLE_EQ(q8.bytes_per_param_device_state, 2.0 + 8.0 / 2048);
  EXPECT_EQ(q8.tag_peak[static_cast<int>(MemoryTag::OptimizerState)],
            static_cast<int64_t>(std::ceil(q8.parameters * (2.0 + 8.0 / 2048))));
  cfg["optimizer"]["step_in_backward"] = true;
  const MemoryPlan inside = plan_memory(cfg);
  EXPECT_EQ(inside.bytes_per_param_grads, 0.0);
  EXPECT_LT(inside.tag_peak[static_cast<int>(MemoryTag::Gradient)], q8.tag_peak[static_cast<int>(MemoryTag::Gradient)]);
  EXPECT_EQ(inside.to_json()["optimizer"]["state_dtype"], "q8");
  cfg["optimizer"]["offload"] = "host";
  cfg["optimizer"]["master_weights"] = "f32";
  const MemoryPlan host = plan_memory(cfg);
  EXPECT_DOUBLE_EQ(host.bytes_per_param_host_state, 4.0 + 2.0 + 8.0 / 2048);
}

}  // namespace
}  // namespace kestrel::train
