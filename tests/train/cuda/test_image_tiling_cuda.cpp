// Tiled VLM data on the GPU (data.image_tiling): 32 px shapes pictures for a 16 px tower, 2 x 2 tiles
// + thumbnail per record (5 tower images, 20 image slots), cut on the prefetch threads, staged in
// pinned memory and copied on the H2D stream; a short bf16 run gives the same losses with prefetching
// as without, its loss falls, and held-out evaluation runs on tiled prompts.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>

#include "kestrel/train/train_config.h"
#include "kestrel/train/trainer.h"
#include "support/gpu.h"
#include "../trainer_fixtures.h"

namespace kestrel::train {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

std::vector<double> tiled_run_losses(const std::string& dir, int prefetch, EvalResult* eval = nullptr) {
  json cfg = testing::tiny_vlm_run(dir, {{"steps", 30}, {"batch_size", 8}},
                                   {{"device", "cuda"}, {"precision", "bf16"}, {"prefetch", prefetch}});
  cfg["data"]["image_size"] = 32;
  cfg["data"]["image_tiling"] = {{"max_tiles", 4}, {"thumbnail", true}};
  {
    Trainer t(cfg);
    t.set_log_callback([](const std::string&) {});
    t.run();
    if (eval) *eval = t.evaluate();
  }
  std::vector<double> l = testing::metric_losses(dir);
  fs::remove_all(dir);
  return l;
}

TEST(ImageTilingCuda, TiledRunTrainsAndPrefetchingLeavesTheLossesUnchanged) {
  KESTREL_REQUIRE_GPU();
  const std::string base = (fs::temp_directory_path() / ("kestrel_tiling_cuda_" + std::to_string(::getpid()))).string();
  EvalResult eval;
  const std::vector<double> inline_run = tiled_run_losses(base + "_inline", 0, &eval);
  const std::vector<double> prefetched = tiled_run_losses(base + "_prefetch", 3);
  ASSERT_EQ(inline_run.size(), 30u);
  ASSERT_EQ(prefetched.size(), 30u);
  for (size_t i = 0; i < 30; ++i) {
    EXPECT_TRUE(std::isfinite(inline_run[i])) << "step " << i + 1;
    EXPECT_NEAR(inline_run[i], prefetched[i], 2e-2 * std::abs(inline_run[i])) << "step " << i + 1;
  }
  EXPECT_LT(inline_run.back(), 0.8 * inline_run.front());
  EXPECT_EQ(eval.samples, 4);
}

}  // namespace
}  // namespace kestrel::train
