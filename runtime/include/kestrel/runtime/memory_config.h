// MemoryConfig: a device's memory settings (and the matmul mode that trades exactness for speed)
// as one typed struct, pushed into the device by configure_memory. The device owns what it is
// given: the caching allocator holds the budget (the one copy of that number), the pinned host pool
// its limit, the offloader its in-flight bound, the matmul its TF32 switch.
//
// Defaults come from the environment, read in one place (runtime/src/environment.cpp), once, the
// way PyTorch reads its allocator config; the README lists the variables. A malformed value is an
// error naming the variable, never a silent fallback:
//   KESTREL_MEMORY_BUDGET        budget                 (bytes, "40GiB"; unset: none)
//   KESTREL_PINNED_LIMIT         pinned_limit           (bytes; 64 GiB)
//   KESTREL_OFFLOAD_INFLIGHT_MB  offload_inflight       (MiB; 256)
//   KESTREL_CUDA_ALLOCATOR       allocator              (vmm | malloc; vmm)
//   KESTREL_MATMUL_TF32          matmul_tf32            (0 | 1; 0)
//   KESTREL_NUM_THREADS          default_cpu_threads()  (count; the hardware's)
// The trainer's config keys (memory_budget, memory.*, threads) take these as their defaults.
// No CUDA types here.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "kestrel/runtime/device.h"

namespace kestrel {

// How the CUDA caching allocator gets segments from the driver: virtual-memory granules
// (cuMemCreate/cuMemMap, unmapped when released) or cudaMalloc/cudaFree.
enum class AllocatorBackend : uint8_t { Vmm, Malloc };
std::string_view allocator_backend_name(AllocatorBackend backend);  // "vmm", "malloc"
// "vmm" | "malloc"; errors name `what` (the key or variable the text came from).
AllocatorBackend parse_allocator_backend(std::string_view text, std::string_view what);

struct MemoryConfig {
  int64_t budget = 0;                              // bytes over reserved + External; 0 = none
  int64_t pinned_limit = int64_t{64} << 30;        // page-locked host pool (process-wide)
  int64_t offload_inflight = int64_t{256} << 20;   // offload copies in flight per device
  AllocatorBackend allocator = AllocatorBackend::Vmm;  // fixed once the device is initialised
  bool matmul_tf32 = false;                        // f32 GEMMs on TF32 tensor cores

  // Throws "[memory] <what>.<field> ..." on a negative budget or a non-positive limit.
  void validate(std::string_view what = "memory") const;
  bool operator==(const MemoryConfig&) const = default;
};

// The environment's defaults (see the table above), parsed at the first call.
const MemoryConfig& default_memory_config();
// KESTREL_NUM_THREADS, else the hardware's concurrency (at least 1).
int default_cpu_threads();
// The parsing itself, over any variable lookup (tests pass their own); errors name the variable.
MemoryConfig memory_config_from_environment(const std::function<const char*(const char*)>& getenv);
int cpu_threads_from_environment(const std::function<const char*(const char*)>& getenv);

// Pushes `config` into `device` (a CUDA device: it is initialised with it when it is not yet; the
// allocator backend cannot change afterwards, an error naming both). A lower budget binds at once:
// cached segments above it go back to the driver. The CPU has no budget or pinned pool: a CPU
// device is an error.
void configure_memory(Device device, const MemoryConfig& config);
// What `device` runs with: its pushed config, or the defaults when it is not initialised (the
// CPU: the defaults).
MemoryConfig memory_config(Device device);

}  // namespace kestrel
