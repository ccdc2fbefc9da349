// Validation of FlashAttentionParams (once per entry point) and the one kernel-choice heuristic:
// a function of the parameters and the device's properties. FlashAttentionParams::kernel forces a
// choice for tests and A/B runs; nothing here reads the environment.
#pragma once

#include "cuda/flash_attention/flash_attention.h"

namespace kestrel::cuda::fa {

struct DeviceProps {
  int cc_major = 0, cc_minor = 0;  // compute capability
  int sm_count = 0;
};
// The current device's properties, read once per device (cudaDeviceGetAttribute) and cached.
DeviceProps current_device_props();

// What runs: the kernel family and the head dim it is instantiated at (64/128 Hopper, 256 MmaSync;
// the real head_dim is zero-padded up to it).
struct KernelChoice {
  FlashKernel kernel;
  int kernel_head_dim;
};
// Auto: Hopper (sm_90) and head_dim <= 128 -> the Hopper kernels at 64 or 128; otherwise the
// mma.sync kernels at 256. Explicit choices are checked against what they can run; throws
// kestrel::Error "[flash_attention] ..." when they cannot (or when `deterministic` asks for it on
// the mma.sync backward). Announces a padded head dim once (log line).
KernelChoice choose_kernel(const FlashAttentionParams& p, const DeviceProps& dev, bool backward);

// Every check on the parameters both directions share; throws kestrel::Error naming flash_attention.
void check_params(const FlashAttentionParams& p);

}  // namespace kestrel::cuda::fa
