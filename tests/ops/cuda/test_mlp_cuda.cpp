// swiglu_mlp_tiled on the GPU: bf16 and f32 against the composed ops in float64 on the CPU, with a
// ragged last tile, a tile larger than T, and accumulation into held weight gradients.
#include <gtest/gtest.h>

#include "../mlp_check.h"
#include "support/gpu.h"

namespace kestrel::testing {
namespace {

TEST(SwigluMlpTiledCuda, MatchesTheFloat64Reference) {
  KESTREL_REQUIRE_GPU();
  expect_tiled_mlp_matches(Device::cuda(0), DType::BF16, 1000, 128, 344, 256, 2e-2);
  expect_tiled_mlp_matches(Device::cuda(0), DType::BF16, 777, 64, 200, 4096, 2e-2);
  expect_tiled_mlp_matches(Device::cuda(0), DType::F32, 515, 96, 160, 128, 1e-4);
}

}  // namespace
}  // namespace kestrel::testing
