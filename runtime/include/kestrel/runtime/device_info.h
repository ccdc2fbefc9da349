// What code needs to know about a device, read from the device (once per device) instead of written
// as literals: its SM count, compute capability and memory, and the dense bf16 tensor-core peak that
// MFU divides by. The peak comes from a table by compute capability (per-SM rate at the data
// sheet's boost clock) times the SM count read from the device; 0 where the table has no entry
// (the CPU, architectures we have not measured), so callers report MFU as unknown.
#pragma once

#include <cstdint>
#include <string>

#include "kestrel/runtime/device.h"

namespace kestrel {

struct DeviceInfo {
  std::string name;
  int sm_count = 0;                     // streaming multiprocessors (0 on the CPU)
  int compute_major = 0, compute_minor = 0;
  int64_t total_memory = 0;             // bytes of device memory (0 on the CPU)
  double peak_bf16_flops = 0.0;         // dense bf16 FLOP/s; 0 when unknown
};

// The device's description; throws kestrel::Error for a CUDA device in a build or on a machine
// without one.
DeviceInfo device_info(Device device);

// Dense bf16 FLOP/s per SM at boost clock for a compute capability: sm_80 (A100: 312 TFLOP/s over
// 108 SMs), sm_90 (H100/H200 SXM: 989 TFLOP/s over 132 SMs), sm_100 (B200: 2.25 PFLOP/s over 148);
// 0 for others.
double peak_bf16_flops_per_sm(int compute_major, int compute_minor);

}  // namespace kestrel
