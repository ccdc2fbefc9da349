// AdamW with optimizer.offload=host on the CPU (the host kernels and the chunk walk; the copy
// pipeline is tested on the GPU): bit-identical to the reference AdamW, and the trainer's
// offloaded runs equal its on-device runs with accumulation and clipping.
#include <gtest/gtest.h>

#include "adamw_offload_check.h"
#include "kestrel/runtime/error.h"
#include "trainer_fixtures.h"

namespace kestrel::train::testing {
namespace {

TEST(AdamWOffload, Bf16ParametersMatchTheReferenceBitForBit) {
  expect_offloaded_adamw_matches_device(Device::cpu(), DType::BF16, {{1000, 37}, {513}, {3, 7, 11}, {1}}, {}, 4, 1.0);
}

TEST(AdamWOffload, F32AndF16ParametersMatchTheReferenceBitForBit) {
  expect_offloaded_adamw_matches_device(Device::cpu(), DType::F32, {{257, 9}, {5}}, {}, 3, 0.5);
  expect_offloaded_adamw_matches_device(Device::cpu(), DType::F16, {{129, 3}, {17}}, {}, 3, 0.0);
}

TEST(AdamWOffload, UnknownOffloadIsRefusedByName) {
  try {
    parse_optimizer_offload("disk");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("\"disk\""), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("\"host\""), std::string::npos) << e.what();
  }
}

// The trainer: a bf16 decoder (CPU, f32 compute of bf16 storage) with accumulation 2 and clipping
// trains the same losses, bit for bit, with the state offloaded.
TEST(AdamWOffload, TrainerRunsEqualOnDeviceRunsWithAccumulationAndClipping) {
  const std::string dir = fresh_temp_dir("kestrel_offload", "trainer");
  nlohmann::json text = {{"model_type", "llama"}, {"vocab_size", 67}, {"hidden_size", 32}, {"intermediate_size", 48},
                         {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                         {"tie_word_embeddings", false}};
  std::vector<std::vector<double>> losses;
  for (const char* offload : {"none", "host"}) {
    nlohmann::json cfg = tiny_decoder_run(dir + "/" + offload, text, 64, 9, 24, 2, "cpu");
    cfg["train"]["steps"] = 5;
    cfg["train"]["grad_accum"] = 2;
    cfg["train"]["grad_clip"] = 0.05;  // small enough that every step clips
    cfg["train"]["lr"] = 1e-2;
    cfg["precision"] = "bf16";
    cfg["optimizer"]["offload"] = offload;
    Trainer t(cfg);
    t.set_log_callback([](const std::string&) {});
    t.run();
    losses.push_back(metric_losses(dir + "/" + offload + "/out"));
  }
  ASSERT_EQ(losses[0].size(), 5u);
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_LT(losses[0].back(), losses[0].front());
}

// Checkpoints hold the offloaded state (host tensors) and a resume restores it: 3 steps, a checkpoint,
// 3 more after a resume equal 6 straight steps bit for bit; and the offloaded state loads from an
// on-device run's checkpoint (the names and shapes are the same).
TEST(AdamWOffload, ResumeFromCheckpointsIsExact) {
  const std::string dir = fresh_temp_dir("kestrel_offload", "resume");
  nlohmann::json text = {{"model_type", "qwen2"}, {"vocab_size", 61}, {"hidden_size", 32}, {"intermediate_size", 40},
                         {"num_hidden_layers", 1}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                         {"tie_word_embeddings", true}};
  auto run_cfg = [&](const std::string& sub, const char* offload, int64_t steps) {
    nlohmann::json cfg = tiny_decoder_run(dir + "/" + sub, text, 48, 7, 20, 2, "cpu");
    cfg["train"]["steps"] = steps;
    cfg["train"]["lr"] = 5e-3;
    cfg["precision"] = "bf16";
    cfg["optimizer"]["offload"] = offload;
    cfg["checkpoint_every"] = 3;
    return cfg;
  };
  {
    Trainer t(run_cfg("straight", "host", 6));
    t.set_log_callback([](const std::string&) {});
    t.run();
  }
  for (const char* first : {"host", "none"}) {
    const std::string sub = std::string("resumed_from_") + first;
    {
      Trainer t(run_cfg(sub, first, 3));
      t.set_log_callback([](const std::string&) {});
      t.run();
    }
    {
      Trainer t(run_cfg(sub, "host", 6));
      t.set_log_callback([](const std::string&) {});
      t.resume("latest");
      t.run();
    }
    EXPECT_EQ(metric_losses(dir + "/straight/out"), metric_losses(dir + "/" + sub + "/out")) << "first 3 steps " << first;
  }
}

}  // namespace
}  // namespace kestrel::train::testing
