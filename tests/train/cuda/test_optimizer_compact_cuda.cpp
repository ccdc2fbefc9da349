// The compact optimizer modes (issue 21) on the GPU: q8 moments offloaded to the host through a small
// staging ring (so chunks split along quantisation blocks and the ring wraps) equal q8 moments on the
// device, and the update inside backward equals the update after it; both bit for bit.
#include <gtest/gtest.h>

#include "../adamw_compact_check.h"
#include "support/gpu.h"

namespace kestrel::train::testing {
namespace {

OptimizerPlacement small_ring() {
  OptimizerPlacement p;
  p.staging_slot_bytes = 1 << 20;  // 512k bf16 elements: 256 blocks of 2048
  p.staging_slots = 2;
  return p;
}

TEST(AdamWCompactCuda, Q8HostOffloadMatchesDeviceBitForBit) {
  KESTREL_REQUIRE_GPU();
  expect_q8_offload_matches_device(Device::cuda(0), DType::BF16, {{1100, 1001}, {513}, {2048, 300}, {1}}, small_ring());
  expect_q8_offload_matches_device(Device::cuda(0), DType::F32, {{700, 1001}, {5}}, small_ring());
}

TEST(AdamWCompactCuda, StepInBackwardEqualsStepAfterBackward) {
  KESTREL_REQUIRE_GPU();
  expect_step_in_backward_matches_step_after(Device::cuda(0), {{1100, 1001}, {17, 33}, {5}}, small_ring());
}

}  // namespace
}  // namespace kestrel::train::testing
