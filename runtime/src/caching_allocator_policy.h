// The policy of the caching device allocator, separated from the driver calls.
//
// Design (PyTorch-style caching allocator, budgeted):
// - Requests are rounded to 512 B. Small requests (<= 1 MiB) are carved from 2 MiB small segments;
//   large requests from segments sized to the request rounded up to the backend's granularity
//   (2 MiB for CUDA virtual memory), so a large tensor wastes < one granule.
// - Free blocks are kept per pool in a best-fit set ordered by (size, address). A block larger
//   than the request is split when the remainder is worth keeping (small: >= 512 B; large: > 1 MiB);
//   freed blocks merge with free neighbours in the same segment.
// - Streams: every block remembers the streams it was last used on. A block is reused by a request
//   on another stream only after that stream is ordered after them (backend.stream_wait_stream,
//   i.e. an event recorded on the old stream and waited on by the new one), never by a host sync.
//   record_stream() adds a stream to an allocated block; its free then waits (pending) for events
//   recorded on the extra streams before the block returns to the cache. Streams used with the
//   allocator must outlive the cached blocks that remember them (like PyTorch's stream pool).
// - Budget ladder, when no cached block fits and a new segment is needed:
//   (1) map it if reserved + external + segment <= budget and the driver has memory;
//   (2) otherwise wait for pending frees, release every fully-free cached segment, retry;
//   (3) otherwise ask the spill hook (spillable blocks go to the pinned host pool), release, retry;
//   (4) otherwise throw OutOfBudget with a report. Nothing in use is touched; the allocator stays usable.
// - Before mapping a new segment, the pool's fully free cached segments (all too small, or they
//   would have served the request) are released, so cached-but-unusable memory does not pile up.
//   Known cost: a large request rounds up to the granule in its own segment; the < 2 MiB tail is
//   only reusable by later requests that fit it (expandable segments would remove this).
// - Accounting: on_alloc/on_free carry the block size (rounded), so in use + cached free == reserved
//   exactly; on_reserve follows every map/unmap.
// This file has no CUDA dependency: CI tests it with a simulated backend.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "kestrel/runtime/allocator.h"
#include "kestrel/runtime/memory_budget.h"
#include "kestrel/runtime/memory_trace.h"

namespace kestrel {

using EventHandle = void*;

// What the policy needs from a device: segments of memory and stream ordering.
class DeviceMemoryBackend {
 public:
  virtual ~DeviceMemoryBackend() = default;
  virtual std::string name() const = 0;
  // Segment sizes are multiples of this (the physical mapping granularity).
  virtual size_t granularity() const = 0;
  // Maps a new segment of `bytes` (a multiple of granularity()); nullptr when the device is full.
  virtual void* map_segment(size_t bytes) = 0;
  virtual void unmap_segment(void* base, size_t bytes) = 0;
  // Makes `waiter` wait for all work submitted so far to `producer` (event record + wait).
  virtual void stream_wait_stream(StreamHandle waiter, StreamHandle producer) = 0;
  virtual EventHandle record_event(StreamHandle stream) = 0;
  virtual bool event_done(EventHandle e) = 0;
  virtual void event_sync(EventHandle e) = 0;
  virtual void destroy_event(EventHandle e) = 0;
  // Called when no cached block fits, before the budget is checked for a new segment (the CUDA
  // backends re-measure External there, so lazily loaded modules are charged).
  virtual void before_map() {}
};

// Given a byte count, frees spillable device memory (returning bytes freed). Called without the
// allocator lock held, so it may deallocate.
using SpillHook = std::function<int64_t(int64_t bytes_needed)>;

class CachingAllocatorPolicy {
 public:
  static constexpr size_t kRound = 512;
  static constexpr size_t kSmallRequest = 1 << 20;   // <= 1 MiB: small pool
  static constexpr size_t kSmallSegment = 2 << 20;   // small pool segment size
  static constexpr size_t kLargeSplitMin = 1 << 20;  // large blocks split only if remainder > 1 MiB

  // `trace` receives the per-tag and reservation accounting (not owned).
  CachingAllocatorPolicy(DeviceMemoryBackend* backend, MemoryTrace* trace, Device device);
  ~CachingAllocatorPolicy();  // releases every segment (blocks still in use are leaked, with a warning)

  // Throws OutOfBudget when the ladder cannot find room.
  Allocation allocate(size_t bytes, MemoryTag tag, StreamHandle stream);
  void deallocate(const Allocation& a);
  void record_stream(const Allocation& a, StreamHandle stream);

  // Budget: bytes (<= 0: unlimited); bounds reserved + external (external read from the trace).
  void set_budget(int64_t bytes);
  int64_t budget() const;
  void set_spill_hook(SpillHook hook);

  // Completes pending frees and unmaps every fully free segment; returns bytes released.
  int64_t release_cached();
  AllocatorPolicyStats stats() const;
  // Checks the internal invariants (segments tile exactly with blocks, no two adjacent free blocks,
  // free sets match the free blocks, counters match). Throws on violation. For tests.
  void check_invariants() const;
  // One entry per block, for tests and the memory tool: {ptr, size, allocated}.
  struct BlockInfo {
    uintptr_t ptr;
    size_t size;
    bool allocated;
    bool small;
  };
  std::vector<BlockInfo> blocks() const;
  OutOfBudgetReport make_report(int64_t request) const;

 private:
  struct Segment;
  struct Block;
  struct BySize {
    bool operator()(const Block* a, const Block* b) const;
  };
  using FreeSet = std::set<Block*, BySize>;

  static size_t round_size(size_t bytes);
  FreeSet& pool(bool small) { return small ? small_free_ : large_free_; }
  Block* find_free(size_t size, bool small, StreamHandle stream);
  Block* map_new_segment(size_t size, bool small);
  Block* take(Block* b, size_t size, StreamHandle stream);
  void free_block(Block* b);
  void process_pending(bool wait);
  void wait_for_streams(const std::vector<StreamHandle>& streams);
  // Unmaps fully free segments (smallest first) until `at_least` bytes (0: all of them); only_pool:
  // -1 both pools, 0 large, 1 small. Nothing when fewer than at_least bytes could be released.
  int64_t release_free_segments(int64_t at_least, int only_pool = -1);
  bool fits_budget(int64_t extra) const;
  OutOfBudgetReport report_locked(int64_t request) const;

  DeviceMemoryBackend* backend_;
  MemoryTrace* trace_;
  Device device_;
  mutable std::mutex mu_;
  std::atomic<int64_t> budget_{0};  // the device's budget: its one owner (memory_config.h)
  SpillHook spill_hook_;
  FreeSet small_free_, large_free_;
  std::vector<Segment*> segments_;
  std::vector<Block*> pending_;  // freed, waiting for record_stream events
  AllocatorPolicyStats st_;
};

}  // namespace kestrel
