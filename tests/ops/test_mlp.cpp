// swiglu_mlp_tiled on the CPU: against the composed linear/swiglu ops in float64 for tiles that divide
// T, leave a ragged last tile, are a single row or exceed T; in f32 and bf16 within their dtype bounds;
// by finite differences; with a frozen weight; and its argument errors.
#include <gtest/gtest.h>

#include "kestrel/runtime/error.h"
#include "mlp_check.h"

namespace kestrel::testing {
namespace {

TEST(SwigluMlpTiled, MatchesTheComposedOpsInFloat64) {
  for (int64_t tile : {1, 4, 7, 37, 64}) expect_tiled_mlp_matches(Device::cpu(), DType::F64, 37, 12, 20, tile, 1e-12);
}

TEST(SwigluMlpTiled, MatchesWithinTheDtypeBound) {
  expect_tiled_mlp_matches(Device::cpu(), DType::F32, 300, 48, 136, 64, 1e-5);
  expect_tiled_mlp_matches(Device::cpu(), DType::BF16, 300, 48, 136, 100, 2e-2);
}

TEST(SwigluMlpTiled, FrozenWeightGetsNoGradient) {
  expect_tiled_mlp_matches(Device::cpu(), DType::F64, 29, 8, 16, 6, 1e-12, /*frozen_up=*/true);
}

TEST(SwigluMlpTiled, GradientsMatchFiniteDifferences) {
  Tensor x = randn({11, 5}, DType::F64), g = randn({9, 5}, DType::F64, Device::cpu(), 0.5),
         u = randn({9, 5}, DType::F64, Device::cpu(), 0.5), d = randn({5, 9}, DType::F64, Device::cpu(), 0.5);
  EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return swiglu_mlp_tiled(in[0], in[1], in[2], in[3], 4); },
                        {x, g, u, d}));
}

TEST(SwigluMlpTiled, RefusesBadArguments) {
  Tensor x = randn({4, 6}), g = randn({8, 6}), u = randn({8, 6}), d = randn({6, 8});
  EXPECT_THROW(swiglu_mlp_tiled(x, g, u, d, 0), Error);
  EXPECT_THROW(swiglu_mlp_tiled(x, g, u, randn({8, 6}), 2), Error);            // down must be [C, I]
  EXPECT_THROW(swiglu_mlp_tiled(randn({4, 5}), g, u, d, 2), Error);            // C mismatch
  EXPECT_THROW(swiglu_mlp_tiled(x, g.to(DType::F64), u, d, 2), Error);         // dtype mismatch
  EXPECT_THROW(swiglu_mlp_tiled(randn({2, 4, 6}), g, u, d, 2), Error);         // 2-D input only
}

}  // namespace
}  // namespace kestrel::testing
