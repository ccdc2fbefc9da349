// optimizer.gradients "host" on the GPU: gradients copied out on the D2H stream as their hooks fire
// equal the device gradients bit for bit, the parameters hold none, and the host clip matches
// clip_grad_norm's.
#include <gtest/gtest.h>

#include "../gradient_stream_check.h"
#include "support/gpu.h"

namespace kestrel::train::testing {
namespace {

TEST(GradientStreamCuda, HostCopiesEqualTheDeviceGradients) {
  KESTREL_REQUIRE_GPU();
  expect_stream_matches_device_gradients(Device::cuda(0), DType::BF16, 0.0);
  expect_stream_matches_device_gradients(Device::cuda(0), DType::F32, 0.01);
}

}  // namespace
}  // namespace kestrel::train::testing
