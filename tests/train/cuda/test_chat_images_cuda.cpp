// Conversation data with images on the GPU (chat_data.h): the bundled sample
// (configs/samples/vlm_chat) trains the tiny VLM in bf16 with images decoded on the prefetch threads,
// staged in pinned memory (a row without images stages an empty pixel array and takes the blank-image
// path), with the same losses as without prefetching; and its first-step loss in f32 matches the CPU's.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>

#include "kestrel/train/train_config.h"
#include "kestrel/train/trainer.h"
#include "support/gpu.h"
#include "../chat_fixtures.h"

namespace kestrel::train {
namespace {
using nlohmann::json;

// Per-step losses of 21 steps (3 passes over the sample's 7 rows, one row a step).
std::vector<double> chat_run_losses(const std::string& device, const std::string& precision, int prefetch,
                                    int64_t steps = 21, const json& more = json::object()) {
  kestrel::testing::TempDir d("kestrel_chat_img_cuda");
  const std::string path = testing::materialise_chat_sample(d);
  const std::string tok = testing::write_chat_tokenizer(d);
  const json cfg = testing::chat_vlm_run(d.file("out"), path, tok, {{"steps", steps}, {"batch_size", 1}, {"lr", 1e-2}},
                                         128, [&] {
                                           json extra = {{"device", device}, {"precision", precision}, {"prefetch", prefetch}};
                                           extra.update(more);
                                           return extra;
                                         }());
  {
    Trainer t(cfg);
    t.set_log_callback([](const std::string&) {});
    t.run();
  }
  return testing::metric_losses(d.file("out"));
}

TEST(ChatImagesCuda, BundledSampleTrainsAndPrefetchingLeavesTheLossesUnchanged) {
  KESTREL_REQUIRE_GPU();
  const std::vector<double> inline_run = chat_run_losses("cuda", "bf16", 0);
  const std::vector<double> prefetched = chat_run_losses("cuda", "bf16", 3);
  ASSERT_EQ(inline_run.size(), 21u);
  ASSERT_EQ(prefetched.size(), 21u);
  for (size_t i = 0; i < inline_run.size(); ++i) {
    EXPECT_TRUE(std::isfinite(inline_run[i])) << "step " << i + 1;
    EXPECT_NEAR(inline_run[i], prefetched[i], 2e-2 * std::abs(inline_run[i])) << "step " << i + 1;
  }
  // The last pass against the first, row by row (each row's loss depends on its content).
  double first = 0, last = 0;
  for (size_t i = 0; i < 7; ++i) first += inline_run[i], last += inline_run[14 + i];
  EXPECT_LT(last, 0.8 * first) << first / 7 << " -> " << last / 7;
}

TEST(ChatImagesCuda, FirstStepLossMatchesTheCpu) {
  KESTREL_REQUIRE_GPU();
  // Same seed, same data: rows 0..4 (one and two images, and row 3 without: the blank-image path). CUDA
  // attention runs in bf16 only, so the GPU run is bf16 against the CPU's f32: the first step's loss is the
  // same forward up to bf16 rounding (1e-2 relative); the next steps carry bf16 updates as well (5e-2).
  const std::vector<double> cpu = chat_run_losses("cpu", "f32", 0, 5);
  const std::vector<double> gpu = chat_run_losses("cuda", "bf16", 0, 5);
  ASSERT_EQ(cpu.size(), 5u);
  ASSERT_EQ(gpu.size(), 5u);
  for (size_t i = 0; i < 5; ++i)
    EXPECT_NEAR(gpu[i], cpu[i], (i == 0 ? 1e-2 : 5e-2) * std::abs(cpu[i])) << "step " << i + 1;
}

}  // namespace
}  // namespace kestrel::train
