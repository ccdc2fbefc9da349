// train.deterministic on the GPU (issue 18 item 7): two runs of one config give bitwise-equal
// losses, weights and optimizer state, and a run cut at a checkpoint and resumed equals the
// straight one bit for bit. Without the setting the embedding backward (atomics) and attention's
// dQ (atomics) reorder their sums run to run, so these runs drift from the first steps on.
// Variants: a decoder on token files with gradient accumulation (in-place gradient accumulation
// of the tied embedding), the same with recompute regions and a tiled MLP, and the VLM (the
// vision tower's bidirectional attention).
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "kestrel/train/train_config.h"
#include "kestrel/train/trainer.h"
#include "support/gpu.h"
#include "../trainer_fixtures.h"

namespace kestrel::train {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

constexpr int64_t kSteps = 6, kCut = 3;

std::vector<uint8_t> file_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

// `base` with out_dir under `dir`, kSteps steps, a checkpoint every kCut, deterministic.
json variant(const std::string& name, const std::string& dir) {
  const json text = {{"model_type", "llama"}, {"vocab_size", 300}, {"hidden_size", 256},
                     {"intermediate_size", 512}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
                     {"num_key_value_heads", 2}, {"max_position_embeddings", 1024}, {"tie_word_embeddings", true}};
  json cfg;
  if (name == "vlm") {
    cfg = testing::tiny_vlm_run(dir + "/out", {{"batch_size", 16}}, {{"device", "cuda"}, {"precision", "bf16"}},
                                /*vision_hidden=*/64, /*text_hidden=*/128);
  } else {
    // 300 ids over 4 x 512 tokens: every id repeats many times per micro-batch.
    cfg = testing::tiny_decoder_run(dir, text, 600, 40, 512, 4, "cuda");
    cfg["train"]["grad_accum"] = 2;
    cfg["train"]["lr"] = 3e-3;
    cfg["train"]["warmup_steps"] = 2;
    if (name == "decoder_recompute") {
      cfg["recompute"] = "recompute";
      cfg["mlp_tile_tokens"] = 512;
    }
  }
  cfg["train"]["steps"] = kSteps;
  cfg["train"]["deterministic"] = true;
  cfg["checkpoint_every"] = kCut;
  cfg["keep_checkpoints"] = 4;
  return cfg;
}

void train(const json& cfg, bool resume) {
  Trainer t(cfg);
  t.set_log_callback([](const std::string&) {});
  if (resume) t.resume("latest");
  t.run();
}

// What must match bit for bit: the losses and the last checkpoint's weights and optimizer state.
struct Outcome {
  std::vector<double> losses;
  std::vector<uint8_t> model, optimizer;
};
Outcome outcome(const json& cfg) {
  const fs::path out = cfg["out_dir"].get<std::string>();
  char step[32];
  std::snprintf(step, sizeof(step), "step_%08lld", static_cast<long long>(kSteps));
  const fs::path last = out / "checkpoints" / step;
  return {testing::metric_losses(out.string()), file_bytes(last / "model.safetensors"),
          file_bytes(last / "optimizer.safetensors")};
}

void expect_same(const Outcome& a, const Outcome& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), static_cast<size_t>(kSteps)) << what;
  ASSERT_EQ(b.losses.size(), static_cast<size_t>(kSteps)) << what;
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_EQ(a.losses[i], b.losses[i]) << what << ": loss of step " << i + 1;
  ASSERT_FALSE(a.model.empty()) << what;
  EXPECT_TRUE(a.model == b.model) << what << ": model.safetensors differs";
  EXPECT_TRUE(a.optimizer == b.optimizer) << what << ": optimizer.safetensors differs";
}

TEST(DeterministicTrainingCuda, TwoRunsAndAResumeAreBitwiseEqual) {
  KESTREL_REQUIRE_GPU();
  const std::string base = (fs::temp_directory_path() / ("kestrel_det_cuda_" + std::to_string(::getpid()))).string();
  for (const std::string name : {"decoder", "decoder_recompute", "vlm"}) {
    SCOPED_TRACE(name);
    const std::string a = base + "/" + name + "_a", b = base + "/" + name + "_b";
    fs::remove_all(a);
    fs::remove_all(b);
    const json ca = variant(name, a), cb = variant(name, b);
    train(ca, false);
    train(cb, false);
    const Outcome first = outcome(ca);
    expect_same(first, outcome(cb), "two runs");
    // Cut run b back to its step-kCut checkpoint and resume it (the resume trims metrics.jsonl).
    char step[32];
    std::snprintf(step, sizeof(step), "step_%08lld", static_cast<long long>(kSteps));
    fs::remove_all(fs::path(cb["out_dir"].get<std::string>()) / "checkpoints" / step);
    train(cb, true);
    expect_same(first, outcome(cb), "straight vs resumed at step " + std::to_string(kCut));
    EXPECT_LT(first.losses.back(), first.losses.front());  // and it trains
  }
  fs::remove_all(base);
}

}  // namespace
}  // namespace kestrel::train
