// MemoryTrace: per-device byte accounting by tag (current and peak), reserved bytes (what the
// allocator holds from the device, in use or cached), counters, and an optional event log with
// phase markers (step/forward/backward/optimizer/region) that the profiling tool reads.
//
// Policy: the allocator calls on_alloc/on_free for every block it hands out and on_reserve for
// every change in what it holds from the driver; External bytes (CUDA context, library
// workspaces the allocator does not see) are charged with set_external. Peaks are exact: they are
// updated on every change, not sampled.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "kestrel/runtime/device.h"
#include "kestrel/runtime/memory.h"

namespace kestrel {

struct TagStats {
  int64_t current = 0;
  int64_t peak = 0;
  int64_t allocated_bytes = 0;  // cumulative
  int64_t freed_bytes = 0;      // cumulative
  int64_t count = 0;            // live blocks
};

enum class MemoryEventKind : uint8_t { Alloc, Free, Reserve, Release, Spill, Restore, Prefetch, Oom, PhaseBegin, PhaseEnd };
std::string_view event_kind_name(MemoryEventKind k);

struct MemoryEvent {
  int64_t time_ns = 0;         // since the trace was created
  MemoryEventKind kind{};
  MemoryTag tag{};
  int64_t bytes = 0;
  int64_t in_use_after = 0;    // bytes in use (all tags) after the event
  int64_t reserved_after = 0;  // bytes reserved after the event
  const void* address = nullptr;
  std::string label;           // phase name, or the allocating MemoryLabelScope label (alloc, oom)
};

struct MemorySnapshot {
  Device device;
  std::array<TagStats, kNumMemoryTags> tags{};
  int64_t in_use = 0;          // sum of tag currents
  int64_t peak_in_use = 0;
  int64_t reserved = 0;        // held from the device (allocator segments), in use or cached
  int64_t peak_reserved = 0;
  int64_t external = 0;        // charged outside the allocator (also in tags[External].current)
  int64_t footprint() const { return reserved + external; }
  int64_t peak_footprint = 0;  // max of reserved + external
  int64_t num_allocs = 0, num_frees = 0, num_retries = 0, num_ooms = 0;
  std::string current_phase;
};

class MemoryTrace {
 public:
  explicit MemoryTrace(Device device);

  void on_alloc(MemoryTag tag, int64_t bytes, const void* address = nullptr);
  void on_free(MemoryTag tag, int64_t bytes, const void* address = nullptr);
  void on_reserve(int64_t delta_bytes);  // + when segments are mapped, - when released
  void set_external(int64_t bytes);      // absolute External charge
  void on_retry();
  void on_oom(int64_t requested_bytes);
  void on_spill(int64_t bytes, bool restore);
  void on_prefetch(int64_t bytes);
  void begin_phase(const std::string& name);
  void end_phase(const std::string& name);

  MemorySnapshot snapshot() const;
  void reset_peaks();  // peaks := currents

  // Event logging is off by default (cheap counters only); profiling turns it on.
  void set_event_logging(bool on, size_t max_events = 1u << 22);
  std::vector<MemoryEvent> events() const;
  void clear_events();

  Device device() const { return device_; }

 private:
  void log(MemoryEventKind kind, MemoryTag tag, int64_t bytes, const void* addr, std::string label);

  Device device_;
  mutable std::mutex mu_;
  MemorySnapshot s_;
  std::vector<std::string> phase_stack_;
  bool logging_ = false;
  size_t max_events_ = 0;
  std::vector<MemoryEvent> events_;
  int64_t t0_ns_ = 0;
};

// The process-wide trace of a device.
MemoryTrace& memory_trace(Device device);

// Marks a phase (e.g. "forward") on a device's trace for the lifetime of the scope.
class PhaseScope {
 public:
  PhaseScope(Device device, std::string name);
  ~PhaseScope();
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  Device device_;
  std::string name_;
};

}  // namespace kestrel
