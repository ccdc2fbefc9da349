// The Allocator interface: every tensor byte is allocated through one, tagged with a MemoryTag.
//
// allocate() returns an Allocation the caller hands back to deallocate() unchanged. Allocators
// report to the device's MemoryTrace. The CPU allocator is a plain aligned malloc; the CUDA
// caching allocator (runtime/cuda) implements the budgeted, stream-aware pool behind this same
// interface and is installed for CUDA devices by the CUDA backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "kestrel/runtime/device.h"
#include "kestrel/runtime/memory.h"

namespace kestrel {

struct Allocation {
  void* ptr = nullptr;
  size_t bytes = 0;        // bytes requested
  MemoryTag tag = MemoryTag::Temporary;
  Device device;
  StreamHandle stream = nullptr;  // the stream the block was allocated for (CUDA)
  void* context = nullptr;        // allocator-private (e.g. its block record)
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual Allocation allocate(size_t bytes, MemoryTag tag, StreamHandle stream) = 0;
  virtual void deallocate(const Allocation& a) = 0;
  // Tells the allocator that `a` is used on `stream` too (its free must wait for that stream).
  virtual void record_stream(const Allocation& a, StreamHandle stream) {}
  virtual Device device() const = 0;
  // Returns cached (free) memory to the device; bytes released. CPU: nothing is cached.
  virtual int64_t release_cached() { return 0; }
};

// Counters of the CUDA caching allocator (cuda::allocator_stats in kestrel/cuda/memory.h).
struct AllocatorPolicyStats {
  int64_t reserved = 0, in_use = 0, cached_free = 0, largest_free = 0;
  int64_t num_segments = 0, num_blocks = 0, num_free_blocks = 0, num_pending = 0;
  int64_t num_maps = 0, num_unmaps = 0, num_cache_hits = 0, num_spill_calls = 0;
  int64_t peak_reserved = 0, peak_in_use = 0;
};

// The allocator that serves a device (CPU: an aligned malloc; CUDA: the installed caching allocator).
Allocator& allocator_for(Device device);
// Replaces the allocator for a device (not owned; must outlive all allocations made through it).
// Used by the CUDA backend and by tests that install simulated allocators.
void set_allocator(Device device, Allocator* allocator);
// The allocator installed for a device, or nullptr (CPU: the default one).
Allocator* installed_allocator(Device device);

}  // namespace kestrel
