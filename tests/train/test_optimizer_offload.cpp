// AdamW with optimizer.offload=host on the CPU (the host kernels and the chunk walk; the copy
// pipeline is tested on the GPU): bit-identical to the reference AdamW, and the trainer's
// offloaded runs equal its on-device runs with accumulation and clipping.
#include <gtest/gtest.h>

#include "adamw_offload_check.h"
#include "kestrel/runtime/error.h"
#include "trainer_fixtures.h"

namespace kestrel::train::testing {
namespace {

using kestrel::testing::rel_l2;

TEST(AdamWOffload, Bf16ParametersMatchTheReferenceBitForBit) {
  expect_offloaded_adamw_matches_device(Device::cpu(), DType::BF16, {{1000, 37}, {513}, {3, 7, 11}, {1}}, {}, 4, 1.0);
}

TEST(AdamWOffload, F32AndF16ParametersMatchTheReferenceBitForBit) {
  expect_offloaded_adamw_matches_device(Device::cpu(), DType::F32, {{257, 9}, {5}}, {}, 3, 0.5);
  expect_offloaded_adamw_matches_device(Device::cpu(), DType::F16, {{129, 3}, {17}}, {}, 3, 0.0);
}

// step_async on a worker thread (optimizer.update_overlap), bf16 and f32 moments and q8, waits in
// forward order and in reverse.
TEST(AdamWOffload, AsyncStepEqualsTheSynchronousStepAndEachWaitGivesTheFinalParameter) {
  expect_async_adamw_matches_sync(Device::cpu(), DType::BF16, {{1000, 37}, {513}, {3, 7, 11}, {1}}, {}, 3, false);
  OptimizerPlacement bf16_moments;
  bf16_moments.state_dtype = DType::BF16;
  expect_async_adamw_matches_sync(Device::cpu(), DType::F32, {{257, 9}, {5}, {64, 3}}, bf16_moments, 3, true);
  OptimizerPlacement q8;
  q8.state_dtype = DType::U8;
  expect_async_adamw_matches_sync(Device::cpu(), DType::BF16, {{300, 41}, {2049}, {7}}, q8, 3, true);
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

// optimizer.state_dtype "bf16": moments stored in bf16 on the host (8 bytes per parameter). Not exact:
// after 30 steps the f32 masters stay within 1% (relative L2) of exact AdamW's, the moments within 2%.
TEST(AdamWOffload, Bf16MomentsStayCloseToExactAdamW) {
  std::vector<std::unique_ptr<Tensor>> owned;
  models::ParameterList exact, compact;
  const std::vector<Shape> shapes = {{300, 17}, {129}};
  twin_parameters(Device::cpu(), DType::BF16, shapes, owned, exact, compact);
  AdamWOptions o;
  o.lr = 1e-2;
  o.beta2 = 0.95;
  o.weight_decay = 0.1;
  OptimizerPlacement host;
  host.offload = OptimizerOffload::Host;
  host.state_dtype = DType::BF16;
  AdamW a(exact, o), b(compact, o, host);
  EXPECT_EQ(b.host_state_bytes(), exact.numel() * 8);
  for (int s = 0; s < 30; ++s) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      Tensor g = randn(shapes[i], DType::F32, Device::cpu(), 1.0).to(DType::BF16);
      exact.get("p" + std::to_string(i)).set_grad(g.clone());
      compact.get("p" + std::to_string(i)).set_grad(g.clone());
    }
    a.step(1e-2);
    b.step(1e-2);
    exact.zero_grad();
    compact.zero_grad();
  }
  auto sa = a.state(), sb = b.state();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t k = 0; k < sa.size(); ++k) {
    ASSERT_EQ(sa[k].first, sb[k].first);
    const bool master = sa[k].first.rfind("master.", 0) == 0;
    EXPECT_EQ(sb[k].second.dtype(), master ? DType::F32 : DType::BF16) << sb[k].first;
    const double err = rel_l2(sb[k].second.to(DType::F64), sa[k].second.to(DType::F64));
    EXPECT_LT(err, master ? 1e-2 : 2e-2) << sa[k].first;
    EXPECT_GT(err, 0.0) << sa[k].first << ": bf16 moments cannot be bit-identical";
  }
}

TEST(AdamWOffload, Bf16MomentsNeedTheHostOffloadAndNamesAreChecked) {
  std::unique_ptr<Tensor> p =
      std::make_unique<Tensor>(models::make_parameter("w", {4, 3}, DType::BF16, Device::cpu()));
  models::ParameterList params;
  params.add("w", p.get());
  OptimizerPlacement on_device;
  on_device.state_dtype = DType::BF16;
  try {
    AdamW bad(params, AdamWOptions{}, on_device);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer.offload"), std::string::npos) << e.what();
  }
  EXPECT_EQ(parse_optimizer_state_dtype("bf16"), DType::BF16);
  EXPECT_THROW(parse_optimizer_state_dtype("int8"), Error);
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
