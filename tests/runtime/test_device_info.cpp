// DeviceInfo: the CPU's description, the bf16 peak table, and (on a GPU) the properties read from
// the device against the runtime's own queries.
#include <gtest/gtest.h>

#include "kestrel/runtime/device_info.h"
#include "kestrel/runtime/error.h"

namespace kestrel {
namespace {

TEST(DeviceInfo, CpuHasNoPeak) {
  const DeviceInfo cpu = device_info(Device::cpu());
  EXPECT_EQ(cpu.name, "cpu");
  EXPECT_EQ(cpu.sm_count, 0);
  EXPECT_EQ(cpu.peak_bf16_flops, 0.0);
}

TEST(DeviceInfo, PeakTableMatchesTheDataSheets) {
  EXPECT_NEAR(peak_bf16_flops_per_sm(9, 0) * 132, 989e12, 1e6);   // H100/H200 SXM
  EXPECT_NEAR(peak_bf16_flops_per_sm(8, 0) * 108, 312e12, 1e6);   // A100
  EXPECT_NEAR(peak_bf16_flops_per_sm(10, 0) * 148, 2250e12, 1e6); // B200
  EXPECT_EQ(peak_bf16_flops_per_sm(7, 5), 0.0);                   // not measured: MFU unknown
}

TEST(DeviceInfo, CudaDeviceReadFromTheDevice) {
  if (cuda_device_count() == 0) {
    EXPECT_THROW(device_info(Device::cuda(0)), Error);
    return;
  }
  const DeviceInfo gpu = device_info(Device::cuda(0));
  EXPECT_FALSE(gpu.name.empty());
  EXPECT_GT(gpu.sm_count, 0);
  EXPECT_GT(gpu.total_memory, 0);
  EXPECT_DOUBLE_EQ(gpu.peak_bf16_flops,
                   peak_bf16_flops_per_sm(gpu.compute_major, gpu.compute_minor) * gpu.sm_count);
}

}  // namespace
}  // namespace kestrel
