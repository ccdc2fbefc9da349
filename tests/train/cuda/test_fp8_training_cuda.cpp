// FP8 training on the GPU (issue 23): a small decoder trained by the Trainer in bf16 with fp8 on
// (selective recompute, grad accumulation: the scales roll once per optimizer step on the device)
// follows the bf16 run's loss within a few percent, and learns; through NCCL at world size 1 the
// amax all-reduce (ReduceOp::Max on the device, before each roll) is the identity: the same FP8 state
// and losses as the plain run.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>

#include "kestrel/models/safetensors.h"
#include "kestrel/runtime/communicator.h"
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

// distributed.backend "nccl" at world size 1 takes the data-parallel path, so every step all-reduces
// the FP8 amax (max over one rank) on the comm stream and the roll waits for it: the checkpointed FP8
// state (histories, scales, rolls) and the losses equal the plain run's, bit for bit where two plain
// runs are (train.deterministic).
TEST(Fp8TrainingCuda, NcclAtWorldSizeOneReducesTheAmaxAsTheIdentity) {
  KESTREL_REQUIRE_GPU();
  if (!nccl_available()) GTEST_SKIP() << "libnccl.so.2 not loadable here";
  const std::string dir = testing::fresh_temp_dir("kestrel_fp8_cuda", "nccl1");
  const json text = {{"model_type", "llama"}, {"vocab_size", 128}, {"hidden_size", 128}, {"intermediate_size", 256},
                     {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}};
  auto run = [&](const std::string& name, const char* backend) {
    json cfg = testing::tiny_decoder_run(dir + "/" + name, text, 400, 20, 128, 4, "cuda:0");
    cfg["train"]["steps"] = 4;
    cfg["checkpoint_every"] = 4;
    cfg["precision"] = "bf16";
    cfg["fp8"]["enabled"] = true;
    cfg["mlp_tile_tokens"] = 0;
    cfg["distributed"]["backend"] = backend;
    cfg["train"]["deterministic"] = true;
    const std::string out = dir + "/" + name + "/out";
    run_losses(cfg, out);
    return out;
  };
  // The FP8 state file's tensors, concatenated bytes in name order.
  auto state = [](const std::string& out) {
    auto r = models::SafetensorsReader::open(out + "/checkpoints/step_00000004/fp8_state.safetensors");
    std::string bytes;
    for (const std::string& n : r.names()) {
      const auto& e = r.get(n);
      bytes.append(reinterpret_cast<const char*>(e.bytes.data()), e.bytes.size());
    }
    return bytes;
  };
  const std::string plain = run("plain", "none"), again = run("again", "none"), nccl = run("nccl", "nccl");
  const bool reproducible = state(plain) == state(again) && testing::metric_losses(plain) == testing::metric_losses(again);
  std::printf("plain vs plain: %s; plain vs nccl: FP8 state %s, losses %s\n", reproducible ? "bitwise equal" : "differ",
              state(plain) == state(nccl) ? "equal" : "differ",
              testing::metric_losses(plain) == testing::metric_losses(nccl) ? "equal" : "differ");
  ASSERT_TRUE(reproducible) << "two plain deterministic FP8 runs differ: the comparison below would mean nothing";
  EXPECT_TRUE(state(plain) == state(nccl)) << "the FP8 state after the amax all-reduce differs from the plain run's";
  EXPECT_EQ(testing::metric_losses(plain), testing::metric_losses(nccl));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kestrel::train
