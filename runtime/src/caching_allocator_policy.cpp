// The caching allocator's policy: pools, best fit, split/merge, stream-aware reuse and the budget
// ladder. The design note is at the top of caching_allocator_policy.h. No CUDA here: the device
// is reached only through DeviceMemoryBackend, so CI runs this against a simulated device.
#include "src/caching_allocator_policy.h"

#include "kestrel/runtime/log.h"

#include <algorithm>
#include <cstdio>

namespace kestrel {

struct CachingAllocatorPolicy::Segment {
  uintptr_t base = 0;
  size_t size = 0;
  bool small = false;
  Block* first = nullptr;
};

struct CachingAllocatorPolicy::Block {
  uintptr_t ptr = 0;
  size_t size = 0;
  Segment* seg = nullptr;
  Block* prev = nullptr;
  Block* next = nullptr;
  bool allocated = false;
  bool pending = false;  // freed, waiting for events on record_stream streams
  bool small = false;
  MemoryTag tag = MemoryTag::Temporary;
  // Allocated: [allocation stream, recorded streams...]. Free: the streams whose submitted work may
  // still touch these bytes (a reuse on another stream waits for them).
  std::vector<StreamHandle> streams;
  std::vector<EventHandle> events;  // pending only
  bool is_free() const { return !allocated && !pending; }
};

bool CachingAllocatorPolicy::BySize::operator()(const Block* a, const Block* b) const {
  return a->size != b->size ? a->size < b->size : a->ptr < b->ptr;
}

CachingAllocatorPolicy::CachingAllocatorPolicy(DeviceMemoryBackend* backend, MemoryTrace* trace, Device device)
    : backend_(backend), trace_(trace), device_(device) {}

CachingAllocatorPolicy::~CachingAllocatorPolicy() {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t leaked = 0;
  std::vector<StreamHandle> streams;  // every stream that may still touch a segment
  for (Segment* s : segments_)
    for (Block* b = s->first; b; b = b->next)
      for (StreamHandle h : b->streams)
        if (std::find(streams.begin(), streams.end(), h) == streams.end()) streams.push_back(h);
  try {
    wait_for_streams(streams);
  } catch (const std::exception& e) {
    log_to(LogLevel::Warning, "allocator", device_.str(), ": waiting for streams at shutdown failed: ", e.what());
  }
  for (Segment* s : segments_) {
    for (Block* b = s->first; b;) {
      if (b->allocated || b->pending) leaked += static_cast<int64_t>(b->size);
      for (EventHandle e : b->events) backend_->destroy_event(e);
      Block* n = b->next;
      delete b;
      b = n;
    }
    backend_->unmap_segment(reinterpret_cast<void*>(s->base), s->size);
    trace_->on_reserve(-static_cast<int64_t>(s->size));
    delete s;
  }
  if (leaked > 0)
    log_to(LogLevel::Warning, "allocator", device_.str(), ": ", leaked, " bytes still in use at shutdown were released");
}

size_t CachingAllocatorPolicy::round_size(size_t bytes) {
  return bytes < kRound ? kRound : (bytes + kRound - 1) / kRound * kRound;
}

void CachingAllocatorPolicy::set_budget(int64_t bytes) { budget_.store(bytes > 0 ? bytes : 0); }

int64_t CachingAllocatorPolicy::budget() const { return budget_.load(std::memory_order_relaxed); }

void CachingAllocatorPolicy::set_spill_hook(SpillHook hook) {
  std::lock_guard<std::mutex> lock(mu_);
  spill_hook_ = std::move(hook);
}

bool CachingAllocatorPolicy::fits_budget(int64_t extra) const {
  int64_t b = budget();
  if (b <= 0) return true;
  return st_.reserved + trace_->snapshot().external + extra <= b;
}

CachingAllocatorPolicy::Block* CachingAllocatorPolicy::find_free(size_t size, bool small, StreamHandle stream) {
  FreeSet& p = pool(small);
  Block key;
  key.size = size;
  auto it = p.lower_bound(&key);
  if (it == p.end()) return nullptr;
  // Among near-best fits (within 1/8), prefer a block last used on this stream: no cross-stream wait.
  Block* best = *it;
  size_t limit = best->size + best->size / 8;
  int scanned = 0;
  for (auto j = it; j != p.end() && scanned < 8 && (*j)->size <= limit; ++j, ++scanned) {
    const auto& s = (*j)->streams;
    if (s.empty() || (s.size() == 1 && s[0] == stream)) return *j;
  }
  return best;
}

CachingAllocatorPolicy::Block* CachingAllocatorPolicy::map_new_segment(size_t seg_size, bool small) {
  void* p = backend_->map_segment(seg_size);
  if (!p) return nullptr;
  auto* s = new Segment{reinterpret_cast<uintptr_t>(p), seg_size, small, nullptr};
  auto* b = new Block;
  b->ptr = s->base;
  b->size = seg_size;
  b->seg = s;
  b->small = small;
  s->first = b;
  segments_.push_back(s);
  st_.reserved += static_cast<int64_t>(seg_size);
  st_.peak_reserved = std::max(st_.peak_reserved, st_.reserved);
  st_.num_maps += 1;
  trace_->on_reserve(static_cast<int64_t>(seg_size));
  pool(small).insert(b);
  return b;
}

CachingAllocatorPolicy::Block* CachingAllocatorPolicy::take(Block* b, size_t size, StreamHandle stream) {
  pool(b->small).erase(b);
  size_t rem = b->size - size;
  bool split = b->small ? rem >= kRound : rem > kLargeSplitMin;
  if (split) {
    auto* r = new Block;
    r->ptr = b->ptr + size;
    r->size = rem;
    r->seg = b->seg;
    r->small = b->small;
    r->prev = b;
    r->next = b->next;
    r->streams = b->streams;  // its bytes were last touched by the same streams
    if (b->next) b->next->prev = r;
    b->next = r;
    b->size = size;
    pool(r->small).insert(r);
  }
  for (StreamHandle s : b->streams)
    if (s != stream) backend_->stream_wait_stream(stream, s);
  b->streams.assign(1, stream);
  b->allocated = true;
  return b;
}

Allocation CachingAllocatorPolicy::allocate(size_t bytes, MemoryTag tag, StreamHandle stream) {
  if (bytes == 0) return Allocation{nullptr, 0, tag, device_, stream, nullptr};
  size_t size = round_size(bytes);
  bool small = size <= kSmallRequest;
  size_t gran = backend_->granularity();
  size_t seg_size = small ? kSmallSegment : (size + gran - 1) / gran * gran;
  if (small && kSmallSegment % gran != 0) seg_size = (kSmallSegment + gran - 1) / gran * gran;

  std::unique_lock<std::mutex> lock(mu_);
  process_pending(false);
  Block* b = find_free(size, small, stream);
  if (b) {
    st_.num_cache_hits += 1;
  } else {
    // Fully free cached segments of this pool are all too small for the request: they go back
    // before a new segment is mapped (keeps reserved close to in use); then the ladder.
    release_free_segments(0, small ? 1 : 0);
    backend_->before_map();
    for (int stage = 0; stage < 3 && !b; ++stage) {
      if (stage == 1) {
        trace_->on_retry();
        process_pending(true);
        b = find_free(size, small, stream);
        if (b) break;
        release_free_segments(INT64_MAX);
      } else if (stage == 2) {
        if (!spill_hook_) break;
        SpillHook hook = spill_hook_;
        int64_t over = budget() > 0 ? st_.reserved + trace_->snapshot().external +
                                          static_cast<int64_t>(seg_size) - budget()
                                    : static_cast<int64_t>(seg_size);
        st_.num_spill_calls += 1;
        lock.unlock();
        int64_t freed = hook(std::max<int64_t>(over, static_cast<int64_t>(size)));
        lock.lock();
        if (freed <= 0) break;
        process_pending(true);
        b = find_free(size, small, stream);
        if (b) break;
        release_free_segments(INT64_MAX);
      }
      if (fits_budget(static_cast<int64_t>(seg_size))) b = map_new_segment(seg_size, small);
    }
    if (!b) {
      trace_->on_oom(static_cast<int64_t>(size));
      OutOfBudgetReport r = report_locked(static_cast<int64_t>(size));
      r.segment = static_cast<int64_t>(seg_size);
      r.device_full = fits_budget(static_cast<int64_t>(seg_size));
      lock.unlock();
      throw OutOfBudget(std::move(r));
    }
  }
  b = take(b, size, stream);
  b->tag = tag;
  st_.in_use += static_cast<int64_t>(b->size);
  st_.peak_in_use = std::max(st_.peak_in_use, st_.in_use);
  trace_->on_alloc(tag, static_cast<int64_t>(b->size), reinterpret_cast<void*>(b->ptr));
  return Allocation{reinterpret_cast<void*>(b->ptr), bytes, tag, device_, stream, b};
}

void CachingAllocatorPolicy::free_block(Block* b) {
  b->allocated = false;
  b->pending = false;
  auto absorb = [&](Block* keep, Block* gone) {
    for (StreamHandle s : gone->streams)
      if (std::find(keep->streams.begin(), keep->streams.end(), s) == keep->streams.end())
        keep->streams.push_back(s);
    keep->size += gone->size;
    keep->next = gone->next;
    if (gone->next) gone->next->prev = keep;
    delete gone;
  };
  if (b->next && b->next->is_free()) {
    pool(b->small).erase(b->next);
    absorb(b, b->next);
  }
  if (b->prev && b->prev->is_free()) {
    Block* p = b->prev;
    pool(p->small).erase(p);
    absorb(p, b);
    b = p;
  }
  pool(b->small).insert(b);
}

void CachingAllocatorPolicy::deallocate(const Allocation& a) {
  if (!a.context) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto* b = static_cast<Block*>(a.context);
  KESTREL_ASSERT(b->allocated);
  trace_->on_free(b->tag, static_cast<int64_t>(b->size), reinterpret_cast<void*>(b->ptr));
  st_.in_use -= static_cast<int64_t>(b->size);
  if (b->streams.size() > 1) {
    // Used on other streams too (record_stream): the block returns to the cache once the work
    // submitted so far on those streams has completed.
    for (size_t i = 1; i < b->streams.size(); ++i) b->events.push_back(backend_->record_event(b->streams[i]));
    b->allocated = false;
    b->pending = true;
    pending_.push_back(b);
    return;
  }
  free_block(b);
}

void CachingAllocatorPolicy::record_stream(const Allocation& a, StreamHandle stream) {
  if (!a.context) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto* b = static_cast<Block*>(a.context);
  if (std::find(b->streams.begin(), b->streams.end(), stream) == b->streams.end()) b->streams.push_back(stream);
}

void CachingAllocatorPolicy::process_pending(bool wait) {
  if (pending_.empty()) return;
  std::vector<Block*> still;
  for (Block* b : pending_) {
    bool done = true;
    for (EventHandle e : b->events) {
      if (wait)
        backend_->event_sync(e);
      else if (!backend_->event_done(e)) {
        done = false;
        break;
      }
    }
    if (!done) {
      still.push_back(b);
      continue;
    }
    for (EventHandle e : b->events) backend_->destroy_event(e);
    b->events.clear();
    b->streams.resize(1);  // the recorded streams' work on it has completed
    free_block(b);
  }
  pending_ = std::move(still);
}

// Unmapping must wait for the work already submitted that may touch the segment: only the streams
// the block was used on (a free block lists them), not the whole device.
void CachingAllocatorPolicy::wait_for_streams(const std::vector<StreamHandle>& streams) {
  for (StreamHandle h : streams) {
    EventHandle e = backend_->record_event(h);
    backend_->event_sync(e);
    backend_->destroy_event(e);
  }
}

int64_t CachingAllocatorPolicy::release_free_segments(int64_t at_least, int only_pool) {
  std::vector<Segment*> candidates;
  int64_t total = 0;
  for (Segment* s : segments_)
    if (s->first->is_free() && !s->first->next && (only_pool < 0 || only_pool == (s->small ? 1 : 0))) {
      candidates.push_back(s);
      total += static_cast<int64_t>(s->size);
    }
  if (candidates.empty() || (at_least != INT64_MAX && total < at_least)) return 0;
  if (at_least == 0) at_least = INT64_MAX;
  std::sort(candidates.begin(), candidates.end(), [](Segment* a, Segment* b) { return a->size < b->size; });
  int64_t released = 0;
  for (Segment* s : candidates) {
    if (released >= at_least) break;
    wait_for_streams(s->first->streams);
    pool(s->small).erase(s->first);
    delete s->first;
    backend_->unmap_segment(reinterpret_cast<void*>(s->base), s->size);
    st_.reserved -= static_cast<int64_t>(s->size);
    st_.num_unmaps += 1;
    trace_->on_reserve(-static_cast<int64_t>(s->size));
    released += static_cast<int64_t>(s->size);
    segments_.erase(std::find(segments_.begin(), segments_.end(), s));
    delete s;
  }
  return released;
}

int64_t CachingAllocatorPolicy::release_cached() {
  std::lock_guard<std::mutex> lock(mu_);
  process_pending(true);
  return release_free_segments(INT64_MAX);
}

AllocatorPolicyStats CachingAllocatorPolicy::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  AllocatorPolicyStats s = st_;
  s.num_segments = static_cast<int64_t>(segments_.size());
  s.num_pending = static_cast<int64_t>(pending_.size());
  s.num_free_blocks = static_cast<int64_t>(small_free_.size() + large_free_.size());
  for (const FreeSet* p : {&small_free_, &large_free_})
    for (const Block* b : *p) {
      s.cached_free += static_cast<int64_t>(b->size);
      s.largest_free = std::max<int64_t>(s.largest_free, static_cast<int64_t>(b->size));
    }
  for (const Segment* seg : segments_)
    for (const Block* b = seg->first; b; b = b->next) s.num_blocks += 1;
  return s;
}

std::vector<CachingAllocatorPolicy::BlockInfo> CachingAllocatorPolicy::blocks() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<BlockInfo> out;
  for (const Segment* seg : segments_)
    for (const Block* b = seg->first; b; b = b->next) out.push_back({b->ptr, b->size, !b->is_free(), b->small});
  return out;
}

void CachingAllocatorPolicy::check_invariants() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t reserved = 0, in_use = 0, pending = 0, free_bytes = 0;
  size_t free_count = 0;
  for (const Segment* seg : segments_) {
    reserved += static_cast<int64_t>(seg->size);
    KESTREL_ASSERT(seg->first && seg->first->ptr == seg->base && !seg->first->prev);
    uintptr_t expect = seg->base;
    for (const Block* b = seg->first; b; b = b->next) {
      KESTREL_ASSERT(b->ptr == expect && b->size > 0 && b->seg == seg && b->small == seg->small);
      KESTREL_ASSERT(b->size % kRound == 0);
      KESTREL_ASSERT(!(b->allocated && b->pending));
      if (b->next) KESTREL_ASSERT(b->next->prev == b);
      if (b->is_free()) {
        KESTREL_ASSERT(!(b->next && b->next->is_free()));  // merged
        KESTREL_ASSERT((b->small ? small_free_ : large_free_).count(const_cast<Block*>(b)) == 1);
        free_bytes += static_cast<int64_t>(b->size);
        ++free_count;
      } else if (b->allocated) {
        in_use += static_cast<int64_t>(b->size);
      } else {
        pending += static_cast<int64_t>(b->size);
      }
      expect += b->size;
    }
    KESTREL_ASSERT(expect == seg->base + seg->size);
  }
  KESTREL_ASSERT(free_count == small_free_.size() + large_free_.size());
  KESTREL_ASSERT(reserved == st_.reserved && in_use == st_.in_use);
  KESTREL_ASSERT(in_use + pending + free_bytes == reserved);
}

OutOfBudgetReport CachingAllocatorPolicy::make_report(int64_t request) const {
  std::lock_guard<std::mutex> lock(mu_);
  return report_locked(request);
}

OutOfBudgetReport CachingAllocatorPolicy::report_locked(int64_t request) const {
  OutOfBudgetReport r;
  MemorySnapshot snap = trace_->snapshot();
  r.device = device_;
  r.request = request;
  r.budget = budget();
  r.reserved = st_.reserved;
  r.external = snap.external;
  r.footprint = r.reserved + r.external;
  r.in_use = st_.in_use;
  for (const FreeSet* p : {&small_free_, &large_free_})
    for (const Block* b : *p) {
      r.cached_free += static_cast<int64_t>(b->size);
      r.largest_free = std::max<int64_t>(r.largest_free, static_cast<int64_t>(b->size));
    }
  r.fragmentation = r.cached_free > 0 ? 1.0 - static_cast<double>(r.largest_free) / r.cached_free : 0.0;
  for (int t = 0; t < kNumMemoryTags; ++t) r.tag_bytes[t] = snap.tags[t].current;
  int64_t short_by = r.footprint + request - std::max<int64_t>(r.budget, 0);
  if (r.cached_free >= request && r.fragmentation > 0.3)
    r.suggestion = "the cache holds " + format_bytes(r.cached_free) + " free but in pieces (largest " +
                   format_bytes(r.largest_free) + "); allocate long-lived tensors first or free "
                   "temporaries earlier";
  else {
    // Name the settings that free the most, largest first: the optimizer state moves to the host
    // whole; saved activations of recompute regions move with recompute=offload.
    const int64_t opt = r.tag_bytes[static_cast<int>(MemoryTag::OptimizerState)];
    std::string moves;
    if (opt > 0)
      moves = "move the optimizer state (" + format_bytes(opt) +
              " here) to host memory with optimizer.offload=host (kestrel-train --set optimizer.offload=host; "
              "AdamW's OptimizerPlacement in the library), ";
    moves += "lower the micro-batch or sequence length, or use recompute=offload (saved layer inputs in host memory)";
    if (r.budget > 0)
      r.suggestion = "raise the budget by at least " + format_bytes(short_by) +
                     " (memory_budget / KESTREL_MEMORY_BUDGET / set_memory_budget), or " + moves;
    else
      r.suggestion = "the device is full: " + moves;
  }
  return r;
}

}  // namespace kestrel
