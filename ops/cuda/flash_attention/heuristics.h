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

// What runs: the kernel family (Hopper or MmaSync; HopperPadded resolves to Hopper) and the head
// dim it is instantiated at (Hopper 64, 80, 96, 112 or 128, MmaSync 256; the real head_dim is
// zero-padded up to it).
struct KernelChoice {
  FlashKernel kernel;
  int kernel_head_dim;
  bool bwd_specialised = false;  // backward: FlashBwdLayout::Specialised (bwd_wgmma_kernel.cuh)
};
// The Hopper kernels' head dim for p: 64 for head_dim <= 64 (padded); in (64, 128) head_dim rounded
// up to 16 (the narrow kernels 80/96/112, traits.h), except 128 for 120, for the prefix-LM and block
// masks and for a deterministic backward (not built narrow), and when `narrow` is false (FlashKernel::HopperPadded);
// 128 for 128.
int hopper_head_dim(const FlashAttentionParams& p, bool backward, bool narrow);
// Auto: Hopper (sm_90) and head_dim <= 128 -> the Hopper kernels at hopper_head_dim; otherwise the
// mma.sync kernels at 256. Explicit choices are checked against what they can run; throws
// kestrel::Error "[flash_attention] ..." when they cannot (or when `deterministic` asks for it on
// the mma.sync backward, or for a block mask outside the Hopper kernels / with `deterministic`). Announces a padded head dim once (log line).
KernelChoice choose_kernel(const FlashAttentionParams& p, const DeviceProps& dev, bool backward);

// Every check on the parameters both directions share; throws kestrel::Error naming flash_attention.
void check_params(const FlashAttentionParams& p);

}  // namespace kestrel::cuda::fa
