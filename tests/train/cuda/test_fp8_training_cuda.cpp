// FP8 training on the GPU (issue 23): a small decoder trained by the Trainer in bf16 with fp8 on
// (selective recompute, grad accumulation: the scales roll once per optimizer step on the device)
// follows the bf16 run's loss within a few percent, and learns.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

#include "kestrel/train/trainer.h"
#include "support/gpu.h"
#include "../trainer_fixtures.h"

namespace kestrel::train {
namespace {
using nlohmann::json;

std::vector<double> run_losses(json cfg, const std::string& out) {
  cfg["out_dir"] = out;
  {
    Trainer t(cfg);
    t.set_log_callback([](const std::string&) {});
    t.run();
  }
  return testing::metric_losses(out);
}

TEST(Fp8TrainingCuda, LossFollowsTheBf16Run) {
  KESTREL_REQUIRE_GPU();
  const std::string dir = testing::fresh_temp_dir("kestrel_fp8_cuda", "follow");
  const json text = {{"model_type", "llama"}, {"vocab_size", 512}, {"hidden_size", 256}, {"intermediate_size", 768},
                     {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}};
  json cfg = testing::tiny_decoder_run(dir, text, 2000, 40, 256, 4, "cuda");
  cfg["train"]["steps"] = 60;
  cfg["train"]["grad_accum"] = 2;
  cfg["train"]["lr"] = 3e-3;
  cfg["train"]["warmup_steps"] = 5;
  cfg["precision"] = "bf16";
  cfg["recompute"] = "selective";
  cfg["mlp_tile_tokens"] = 0;
  const std::vector<double> ref = run_losses(cfg, dir + "/bf16");
  cfg["fp8"]["enabled"] = true;
  const std::vector<double> fp8 = run_losses(cfg, dir + "/fp8");
  ASSERT_EQ(ref.size(), 60u);
  ASSERT_EQ(fp8.size(), 60u);
  auto mean_last = [](const std::vector<double>& v) {
    double s = 0;
    for (size_t i = v.size() - 10; i < v.size(); ++i) s += v[i];
    return s / 10;
  };
  for (size_t i = 0; i < ref.size(); i += 10) std::printf("step %zu: bf16 %.4f fp8 %.4f\n", i + 1, ref[i], fp8[i]);
  std::printf("last 10 steps: bf16 %.4f fp8 %.4f\n", mean_last(ref), mean_last(fp8));
  EXPECT_LT(mean_last(fp8), 0.7 * fp8[0]);
  EXPECT_NEAR(mean_last(fp8), mean_last(ref), 0.05 * mean_last(ref));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kestrel::train
