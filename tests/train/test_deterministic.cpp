// train.deterministic (issue 18 item 7) on the CPU: the key's typing, its path to every model of a
// task (decoder, and the VLM's vision tower), a resume that switches it on (not a config change:
// the same maths summed in a fixed order) equal bit for bit to the straight run, and runs and the
// host-side reductions an offloaded optimizer uses (the global gradient norm) independent of the
// pool's thread count (`threads` may change on resume). The GPU runs (two runs and a resume, bitwise) are in tests/train/cuda.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "kestrel/models/vlm.h"
#include "kestrel/ops/optim.h"
#include "kestrel/runtime/parallel.h"
#include "kestrel/train/run_config.h"
#include "kestrel/train/train_config.h"
#include "kestrel/train/trainer.h"
#include "support/errors.h"
#include "support/numerics.h"
#include "train/src/tasks.h"
#include "trainer_fixtures.h"

namespace kestrel::train {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

std::string deterministic_tmp(const std::string& n) { return testing::fresh_temp_dir("kestrel_deterministic", n); }

TEST(Deterministic, ConfigKeyIsATypedBoolean) {
  json cfg = default_train_config();
  EXPECT_FALSE(RunConfig::resolve(cfg).deterministic);
  apply_override(cfg, "train.deterministic=true");
  EXPECT_TRUE(RunConfig::resolve(cfg).deterministic);
  EXPECT_TRUE(RunConfig::resolve(resolve_train_config({{"train", {{"deterministic", true}}}}, "run.json")).deterministic);
  std::string msg = kestrel::testing::error_of([] {
    resolve_train_config({{"train", {{"deterministic", "yes"}}}}, "run.json");
  });
  kestrel::testing::expect_has(msg, {"run.json", "train.deterministic", "boolean"});
  msg = kestrel::testing::error_of([] {
    json c = default_train_config();
    apply_override(c, "train.deterministic=1");
  });
  kestrel::testing::expect_has(msg, {"train.deterministic", "boolean"});
  // The example config (the 1.5B at 8k, deterministic) resolves with it on.
  const fs::path example = fs::path(__FILE__).parent_path() / ".." / ".." / "configs" / "llama_1b5_8k_deterministic.json";
  std::ifstream f(example);
  ASSERT_TRUE(f.good()) << example;
  const RunConfig ex = RunConfig::resolve(resolve_train_config(json::parse(f), example.string()));
  EXPECT_TRUE(ex.deterministic);
  EXPECT_TRUE(ex.device.is_cuda());
}

TEST(Deterministic, TheSettingReachesEveryModelOfTheTask) {
  const std::string dir = deterministic_tmp("tasks");
  const json text = {{"model_type", "llama"}, {"vocab_size", 64}, {"hidden_size", 32}, {"intermediate_size", 64},
                     {"num_hidden_layers", 1}, {"num_attention_heads", 2}, {"num_key_value_heads", 1}};
  const json configs[] = {testing::tiny_vlm_run(dir + "/vlm", {{"steps", 1}}),
                          testing::tiny_decoder_run(dir + "/dec", text, 8, 3, 16, 2, "cpu")};
  for (const json& cfg : configs) {
    std::unique_ptr<Task> task = make_task(cfg, DType::F32, Device::cpu());
    ASSERT_NE(task->decoder(), nullptr) << task->name();
    EXPECT_FALSE(task->decoder()->deterministic()) << task->name();
    task->set_deterministic(true);
    EXPECT_TRUE(task->decoder()->deterministic()) << task->name();
    task->set_deterministic(false);
    EXPECT_FALSE(task->decoder()->deterministic()) << task->name();
  }
  // The VLM passes it to both towers.
  models::VlmConfig vc = models::VlmConfig::from_json(configs[0]["model"]["config"]);
  models::Vlm vlm(vc, DType::F32, Device::cpu());
  vlm.set_deterministic(true);
  EXPECT_TRUE(vlm.vision().deterministic());
  EXPECT_TRUE(vlm.decoder().deterministic());
  fs::remove_all(dir);
}

std::vector<uint8_t> file_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

TEST(Deterministic, ResumingWithItSwitchedOnIsNotAConfigChangeAndStaysExact) {
  // Straight: 8 steps. Cut: the same run checkpointed at 4 (the step-8 checkpoint removed), then
  // resumed with train.deterministic on. On the CPU both settings run the same kernels, so the
  // resumed run must equal the straight one bit for bit (losses and final weights).
  const std::string a = deterministic_tmp("straight"), b = deterministic_tmp("cut");
  auto cfg = [](const std::string& dir, bool det) {
    return testing::tiny_vlm_run(dir, {{"steps", 8}, {"batch_size", 4}, {"deterministic", det}},
                                 {{"checkpoint_every", 4}});
  };
  for (const auto& [dir, det] : {std::pair{a, false}, std::pair{b, false}}) {
    Trainer t(cfg(dir, det));
    t.set_log_callback([](const std::string&) {});
    t.run();
  }
  fs::remove_all(fs::path(b) / "checkpoints" / "step_00000008");
  {
    Trainer t(cfg(b, true));
    std::string log;
    t.set_log_callback([&](const std::string& s) { log += s + "\n"; });
    t.resume("latest");  // no allow_config_change: train.deterministic is not compared
    t.run();
  }
  const std::vector<double> la = testing::metric_losses(a), lb = testing::metric_losses(b);
  ASSERT_EQ(la.size(), 8u);
  ASSERT_EQ(lb.size(), 8u);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(la[i], lb[i]) << "step " << i + 1;
  const fs::path last = fs::path("checkpoints") / "step_00000008";
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    const std::vector<uint8_t> fa = file_bytes(fs::path(a) / last / f), fb = file_bytes(fs::path(b) / last / f);
    ASSERT_FALSE(fa.empty()) << f;
    EXPECT_TRUE(fa == fb) << f << " differs between the straight and the resumed run";
  }
  fs::remove_all(a);
  fs::remove_all(b);
}

TEST(Deterministic, TheThreadCountDoesNotChangeTheBits) {
  // `threads` may differ on resume (not compared), so a CPU run's bits must not depend on it: every
  // CPU reduction splits at fixed blocks and adds the partials in block order.
  const std::string dir = deterministic_tmp("threads");
  const int before = num_cpu_threads();
  const json text = {{"model_type", "llama"}, {"vocab_size", 64}, {"hidden_size", 32}, {"intermediate_size", 64},
                     {"num_hidden_layers", 2}, {"num_attention_heads", 2}, {"num_key_value_heads", 1}};
  for (const std::string task : {"vlm", "decoder"}) {
    std::vector<std::vector<double>> runs;
    for (int threads : {1, 2, 3}) {
      const std::string d = dir + "/" + task + std::to_string(threads);
      json cfg = task == "vlm" ? testing::tiny_vlm_run(d, {{"steps", 6}, {"batch_size", 4}})
                               : testing::tiny_decoder_run(d, text, 64, 9, 32, 4, "cpu");
      cfg["train"]["steps"] = 6;
      cfg["threads"] = threads;
      Trainer t(cfg);
      t.set_log_callback([](const std::string&) {});
      t.run();
      runs.push_back(testing::metric_losses(cfg["out_dir"].get<std::string>()));
    }
    ASSERT_EQ(runs[0].size(), 6u) << task;
    for (size_t i = 0; i < runs[0].size(); ++i) {
      EXPECT_EQ(runs[0][i], runs[1][i]) << task << " step " << i + 1;
      EXPECT_EQ(runs[0][i], runs[2][i]) << task << " step " << i + 1;
    }
  }
  set_num_cpu_threads(before);
  fs::remove_all(dir);
}

TEST(Deterministic, HostGradientNormIsTheSameForAnyThreadCount) {
  // optimizer.gradients "host" takes the global norm on the host (clip_grad_norm over CPU tensors):
  // per-block partials in a fixed order, so neither thread timing nor the pool's split changes it.
  std::vector<Tensor> grads = {kestrel::testing::randn({1 << 20}), kestrel::testing::randn({777, 129}, DType::BF16),
                               kestrel::testing::randn({3})};
  const int before = num_cpu_threads();
  std::vector<double> norms;
  for (int threads : {1, 2, 3, 1}) {
    set_num_cpu_threads(threads);
    norms.push_back(global_grad_norm(grads));
  }
  set_num_cpu_threads(before);
  for (double n : norms) EXPECT_EQ(n, norms[0]);
}

}  // namespace
}  // namespace kestrel::train
