// OpProfile on the GPU: CUDA-event brackets on the current stream, resolved at stop(); each
// dispatch counted once, device time positive and within the wall time.
#include <gtest/gtest.h>

#include <chrono>

#include "kestrel/ops/matmul.h"
#include "kestrel/runtime/accumulate.h"
#include "kestrel/runtime/op_profile.h"
#include "support/gpu.h"
#include "support/numerics.h"

namespace kestrel {
namespace {

TEST(OpProfileCuda, EventBracketsTimeEachDispatch) {
  KESTREL_REQUIRE_GPU();
  Tensor a = testing::randn({2048, 2048}, DType::F32, Device::cpu(), 1.0).to(DType::BF16).to(Device::cuda(0));
  Tensor b = testing::randn({2048, 2048}, DType::F32, Device::cpu(), 1.0).to(DType::BF16).to(Device::cuda(0));
  (void)matmul(a, b);
  synchronize(Device::cuda(0));
  OpProfile p;
  const auto t0 = std::chrono::steady_clock::now();
  p.start();
  Tensor c;
  for (int i = 0; i < 5; ++i) c = matmul(a, b);
  p.stop();
  const double wall = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(p.ops().size(), 1u);
  EXPECT_EQ(p.ops()[0].op, "matmul");
  EXPECT_EQ(p.ops()[0].calls, 5);
  EXPECT_GT(p.ops()[0].ms, 0.0);
  EXPECT_LE(p.ops()[0].ms, wall);
}

}  // namespace
}  // namespace kestrel
