// AdamW with optimizer.offload=host on the GPU: gradients staged through a small pinned ring (2
// slots of 1 MiB, so large parameters split into several chunks and the ring wraps many times),
// updated on the CPU and copied back, must equal the on-device AdamW bit for bit.
#include <gtest/gtest.h>

#include "../adamw_offload_check.h"
#include "support/gpu.h"

namespace kestrel::train::testing {
namespace {

TEST(AdamWOffloadCuda, Bf16ThroughASmallRingMatchesTheDeviceAdamWBitForBit) {
  KESTREL_REQUIRE_GPU();
  OptimizerPlacement p;
  p.staging_slot_bytes = 1 << 20;
  p.staging_slots = 2;
  expect_offloaded_adamw_matches_device(Device::cuda(0), DType::BF16,
                                        {{1100, 1001}, {513}, {3, 7, 11}, {2048, 300}, {1}}, p, 4, 1.0);
}

TEST(AdamWOffloadCuda, F32AndF16MatchTheDeviceAdamWBitForBit) {
  KESTREL_REQUIRE_GPU();
  OptimizerPlacement p;
  p.staging_slot_bytes = 1 << 20;
  p.staging_slots = 3;
  expect_offloaded_adamw_matches_device(Device::cuda(0), DType::F32, {{700, 1001}, {5}}, p, 3, 0.5);
  expect_offloaded_adamw_matches_device(Device::cuda(0), DType::F16, {{999, 1200}, {17}}, p, 3, 0.0);
}

// step_async: the worker thread's copies reach the compute stream through per-parameter markers; a
// small ring so every parameter spans several chunks and the ring wraps.
TEST(AdamWOffloadCuda, AsyncStepEqualsTheSynchronousStepAndEachWaitGivesTheFinalParameter) {
  KESTREL_REQUIRE_GPU();
  OptimizerPlacement p;
  p.staging_slot_bytes = 1 << 20;
  p.staging_slots = 2;
  expect_async_adamw_matches_sync(Device::cuda(0), DType::BF16, {{1100, 1001}, {513}, {2048, 300}, {1}}, p, 3, false);
  p.state_dtype = DType::BF16;
  expect_async_adamw_matches_sync(Device::cuda(0), DType::BF16, {{999, 1200}, {17}, {3, 7, 11}}, p, 3, true);
}

}  // namespace
}  // namespace kestrel::train::testing
