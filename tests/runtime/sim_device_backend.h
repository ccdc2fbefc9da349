// A simulated device for the caching allocator's policy: a bump address space with a capacity,
// mapped segments checked on unmap (the test can check that their last uses had finished), and streams modelled by logical clocks so a test can verify
// that every cross-stream reuse was ordered (waited on) after the old stream's last use.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/src/caching_allocator_policy.h"

namespace kestrel::testing {

class SimDeviceBackend final : public DeviceMemoryBackend {
 public:
  static constexpr size_t kGranule = 2 << 20;
  explicit SimDeviceBackend(int64_t capacity, uint32_t seed = 1) : capacity_(capacity), rng_(seed) {}

  std::string name() const override { return "sim"; }
  size_t granularity() const override { return kGranule; }
  void* map_segment(size_t bytes) override {
    if (bytes % kGranule) throw std::logic_error("segment not a multiple of the granule");
    if (mapped_ + static_cast<int64_t>(bytes) > capacity_) return nullptr;
    uintptr_t base = next_;
    next_ += bytes + kGranule;  // a hole between segments: adjacent segments never look contiguous
    segments_[base] = bytes;
    mapped_ += static_cast<int64_t>(bytes);
    peak_mapped_ = std::max(peak_mapped_, mapped_);
    return reinterpret_cast<void*>(base);
  }
  void unmap_segment(void* base, size_t bytes) override {
    auto it = segments_.find(reinterpret_cast<uintptr_t>(base));
    if (it == segments_.end() || it->second != bytes) throw std::logic_error("unmap of an unknown segment");
    if (on_unmap) on_unmap(reinterpret_cast<uintptr_t>(base), bytes);
    segments_.erase(it);
    mapped_ -= static_cast<int64_t>(bytes);
  }
  // Called before a segment is unmapped (a test checks that no submitted use of it is unfinished).
  std::function<void(uintptr_t base, size_t bytes)> on_unmap;
  // True when the device has finished the use `seq` on stream s.
  bool finished(StreamHandle s, int64_t seq) { return completed_[sid(s)] >= seq; }

  // ---- streams as logical clocks ----
  int sid(StreamHandle s) const { return static_cast<int>(reinterpret_cast<uintptr_t>(s)); }
  // A use of memory on stream s: returns the sequence number of that use.
  int64_t use(StreamHandle s) { return ++seq_[sid(s)]; }
  void stream_wait_stream(StreamHandle waiter, StreamHandle producer) override {
    int w = sid(waiter), p = sid(producer);
    known_[w][p] = std::max(known_[w][p], seq_[p]);
    for (auto& [q, v] : known_[p]) known_[w][q] = std::max(known_[w][q], v);
    ++num_waits_;
  }
  EventHandle record_event(StreamHandle s) override {
    events_.push_back({sid(s), seq_[sid(s)], false});
    return reinterpret_cast<EventHandle>(events_.size());  // 1-based
  }
  bool event_done(EventHandle e) override {
    Event& ev = ev_of(e);
    if (!ev.done && std::bernoulli_distribution(0.3)(rng_)) complete(ev);
    return ev.done;
  }
  void event_sync(EventHandle e) override { complete(ev_of(e)); }
  void destroy_event(EventHandle e) override { ++destroyed_; }

  // True when stream `consumer` may touch bytes last used on `producer` at sequence `use_seq`.
  bool ordered(StreamHandle consumer, StreamHandle producer, int64_t use_seq) {
    int c = sid(consumer), p = sid(producer);
    if (c == p) return true;
    return known_[c][p] >= use_seq || completed_[p] >= use_seq;
  }

  int64_t mapped() const { return mapped_; }
  int64_t peak_mapped() const { return peak_mapped_; }
  int64_t num_waits() const { return num_waits_; }
  size_t events_created() const { return events_.size(); }
  size_t events_destroyed() const { return destroyed_; }

 private:
  struct Event {
    int stream;
    int64_t seq;
    bool done;
  };
  Event& ev_of(EventHandle e) { return events_.at(reinterpret_cast<uintptr_t>(e) - 1); }
  void complete(Event& ev) {
    ev.done = true;
    completed_[ev.stream] = std::max(completed_[ev.stream], ev.seq);
  }

  int64_t capacity_;
  std::mt19937 rng_;
  uintptr_t next_ = uintptr_t{1} << 40;
  std::map<uintptr_t, size_t> segments_;
  int64_t mapped_ = 0, peak_mapped_ = 0, num_waits_ = 0;
  std::map<int, int64_t> seq_, completed_;
  std::map<int, std::map<int, int64_t>> known_;
  std::vector<Event> events_;
  size_t destroyed_ = 0;
};

}  // namespace kestrel::testing
