// MemoryBudget: one limit per device bounding the whole process footprint on it.
//
// The footprint is what the allocator holds from the driver (reserved segments, in use or cached)
// plus External bytes that bypass the allocator (CUDA context, cuBLAS/cuDNN/NCCL internals, measured
// with cudaMemGetInfo around their initialisation). A request that would cross the budget runs the
// allocator's ladder (reuse cache -> release cached segments -> spill spillable blocks to the pinned
// host pool) and, when nothing helps, throws OutOfBudget carrying a report. No CUDA types here.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "kestrel/runtime/device.h"
#include "kestrel/runtime/error.h"
#include "kestrel/runtime/memory.h"

namespace kestrel {

// What was asked, what is held, and why it did not fit.
struct OutOfBudgetReport {
  Device device;
  int64_t request = 0;         // bytes asked for (rounded as the allocator would)
  int64_t segment = 0;         // bytes a new segment would have needed from the device
  int64_t budget = 0;          // <= 0: no budget (the device itself was full)
  int64_t footprint = 0;       // reserved + external
  int64_t reserved = 0;
  int64_t in_use = 0;
  int64_t external = 0;
  int64_t cached_free = 0;     // reserved - in use
  int64_t largest_free = 0;    // largest cached free block
  double fragmentation = 0.0;  // 1 - largest_free / cached_free (0 when nothing cached)
  std::array<int64_t, kNumMemoryTags> tag_bytes{};
  bool device_full = false;    // the driver refused, not the budget
  std::string suggestion;
  std::string str() const;     // the multi-line text carried by OutOfBudget::what()
};

class OutOfBudget : public Error {
 public:
  explicit OutOfBudget(OutOfBudgetReport report);
  const OutOfBudgetReport& report() const { return report_; }

 private:
  OutOfBudgetReport report_;
};

// The budget alone, through configure_memory (memory_config.h: the device's caching allocator holds
// it). Sets the budget of a CUDA device (<= 0 removes it); lowering it below the current footprint
// releases the allocator's cached segments at once; memory in use stays, and the next allocation
// that needs a new segment meets the budget ladder. The CPU has none (an error to set, 0 to read).
void set_memory_budget(Device device, int64_t bytes);
int64_t memory_budget(Device device);  // 0 when none
// The device footprint as the runtime accounts it: reserved + external (memory_trace(device)).
int64_t device_footprint(Device device);
int64_t device_peak_footprint(Device device);

// "40GiB", "1.5 GiB", "512MiB", "4096", "2G" (binary: K/M/G/T = KiB/MiB/GiB/TiB), "3GB" (decimal).
int64_t parse_bytes(std::string_view text);
// 1536 -> "1.50 KiB"
std::string format_bytes(int64_t bytes);

}  // namespace kestrel
