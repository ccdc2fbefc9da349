// The trainer on the GPU: batches prepared on the prefetch thread, staged in pinned memory and
// copied on the H2D stream arrive intact and in order for compute-stream work issued right after
// get() (large arrays, so a missing event wait would read the previous batch's block); a short bf16
// VLM run gives the same losses with prefetching as without.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "train/src/batch_prefetcher.h"
#include "kestrel/train/train_config.h"
#include "kestrel/train/trainer.h"
#include "support/gpu.h"
#include "../trainer_fixtures.h"

namespace kestrel::train {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

constexpr int64_t kN = 1 << 20;  // 8 MiB of i64 per batch

HostBatch big(uint64_t index) {
  std::vector<int64_t> v(static_cast<size_t>(kN));
  for (int64_t i = 0; i < kN; ++i) v[static_cast<size_t>(i)] = static_cast<int64_t>(index) * 3 + i % 1000;
  HostBatch b;
  b.arrays.push_back(host_array(v, {kN}, DType::I64));
  return b;
}

TEST(PrefetchCuda, BatchesArriveBeforeComputeReadsThem) {
  KESTREL_REQUIRE_GPU();
  for (int depth : {0, 2}) {
    BatchPrefetcher p(big, Device::cuda(0), depth);
    std::vector<uint64_t> order;
    for (uint64_t i = 0; i < 12; ++i) order.push_back(i);
    order.insert(order.end(), {100, 101, 102, 5, 6});
    for (uint64_t index : order) {
      BatchPrefetcher::Batch b = p.get(index);
      ASSERT_EQ(b.host->index, index);
      Tensor copy = b.arrays[0].clone();  // compute-stream work right after get()
      std::vector<int64_t> got = copy.to_int_vector();
      int64_t bad = 0;
      for (int64_t i = 0; i < kN; ++i) bad += got[static_cast<size_t>(i)] != static_cast<int64_t>(index) * 3 + i % 1000;
      EXPECT_EQ(bad, 0) << "depth " << depth << " index " << index;
    }
  }
}

std::vector<double> run_losses(const std::string& dir, int64_t prefetch) {
  // bf16: attention on CUDA runs in bf16/f16 only.
  const json cfg = testing::tiny_vlm_run(dir, {{"steps", 8}, {"batch_size", 16}, {"grad_accum", 2}},
                                         {{"device", "cuda"}, {"precision", "bf16"}, {"prefetch", prefetch}},
                                         /*vision_hidden=*/32, /*text_hidden=*/64);
  fs::remove_all(dir);
  {
    Trainer t(cfg);
    t.set_log_callback([](const std::string&) {});
    t.run();
  }
  std::vector<double> l = testing::metric_losses(dir);
  fs::remove_all(dir);
  return l;
}

TEST(TrainerCuda, PrefetchingLeavesTheLossesUnchanged) {
  KESTREL_REQUIRE_GPU();
  const std::string base = (fs::temp_directory_path() / ("kestrel_train_cuda_" + std::to_string(::getpid()))).string();
  std::vector<double> inline_run = run_losses(base + "_inline", 0), prefetched = run_losses(base + "_prefetch", 3);
  ASSERT_EQ(inline_run.size(), 8u);
  ASSERT_EQ(prefetched.size(), 8u);
  // The same batches give the same losses up to bf16 rounding and atomic reduction order (the exact
  // contents of prefetched batches are checked above).
  for (size_t i = 0; i < 8; ++i) EXPECT_NEAR(inline_run[i], prefetched[i], 2e-2 * std::abs(inline_run[i])) << "step " << i + 1;
  EXPECT_LT(inline_run.back(), inline_run.front());
}

}  // namespace
}  // namespace kestrel::train
