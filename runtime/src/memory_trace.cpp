#include "kestrel/runtime/memory_trace.h"

#include <chrono>
#include <map>
#include <memory>

namespace kestrel {
namespace {
int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

std::string_view event_kind_name(MemoryEventKind k) {
  switch (k) {
    case MemoryEventKind::Alloc: return "alloc";
    case MemoryEventKind::Free: return "free";
    case MemoryEventKind::Reserve: return "reserve";
    case MemoryEventKind::Release: return "release";
    case MemoryEventKind::Spill: return "spill";
    case MemoryEventKind::Restore: return "restore";
    case MemoryEventKind::Prefetch: return "prefetch";
    case MemoryEventKind::Oom: return "oom";
    case MemoryEventKind::PhaseBegin: return "phase_begin";
    case MemoryEventKind::PhaseEnd: return "phase_end";
  }
  return "?";
}

MemoryTrace::MemoryTrace(Device device) : device_(device), t0_ns_(now_ns()) { s_.device = device; }

void MemoryTrace::log(MemoryEventKind kind, MemoryTag tag, int64_t bytes, const void* addr, std::string label) {
  if (!logging_ || events_.size() >= max_events_) return;
  events_.push_back({now_ns() - t0_ns_, kind, tag, bytes, s_.in_use, s_.reserved, addr, std::move(label)});
}

void MemoryTrace::on_alloc(MemoryTag tag, int64_t bytes, const void* address) {
  std::lock_guard<std::mutex> lock(mu_);
  TagStats& t = s_.tags[static_cast<int>(tag)];
  t.current += bytes;
  t.allocated_bytes += bytes;
  t.count += 1;
  if (t.current > t.peak) t.peak = t.current;
  s_.in_use += bytes;
  if (s_.in_use > s_.peak_in_use) s_.peak_in_use = s_.in_use;
  s_.num_allocs += 1;
  if (logging_) log(MemoryEventKind::Alloc, tag, bytes, address, current_memory_label());
}

void MemoryTrace::on_free(MemoryTag tag, int64_t bytes, const void* address) {
  std::lock_guard<std::mutex> lock(mu_);
  TagStats& t = s_.tags[static_cast<int>(tag)];
  t.current -= bytes;
  t.freed_bytes += bytes;
  t.count -= 1;
  s_.in_use -= bytes;
  s_.num_frees += 1;
  log(MemoryEventKind::Free, tag, bytes, address, {});
}

void MemoryTrace::on_reserve(int64_t delta) {
  std::lock_guard<std::mutex> lock(mu_);
  s_.reserved += delta;
  if (s_.reserved > s_.peak_reserved) s_.peak_reserved = s_.reserved;
  if (s_.footprint() > s_.peak_footprint) s_.peak_footprint = s_.footprint();
  log(delta >= 0 ? MemoryEventKind::Reserve : MemoryEventKind::Release, MemoryTag::Temporary,
      delta >= 0 ? delta : -delta, nullptr, {});
}

void MemoryTrace::set_external(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  TagStats& t = s_.tags[static_cast<int>(MemoryTag::External)];
  int64_t delta = bytes - s_.external;
  s_.external = bytes;
  t.current = bytes;
  if (t.current > t.peak) t.peak = t.current;
  if (delta > 0) t.allocated_bytes += delta;
  if (s_.footprint() > s_.peak_footprint) s_.peak_footprint = s_.footprint();
}

void MemoryTrace::on_retry() {
  std::lock_guard<std::mutex> lock(mu_);
  s_.num_retries += 1;
}

void MemoryTrace::on_oom(int64_t requested) {
  std::lock_guard<std::mutex> lock(mu_);
  s_.num_ooms += 1;
  log(MemoryEventKind::Oom, current_memory_tag(), requested, nullptr, logging_ ? current_memory_label() : std::string());
}

void MemoryTrace::on_spill(int64_t bytes, bool restore) {
  std::lock_guard<std::mutex> lock(mu_);
  log(restore ? MemoryEventKind::Restore : MemoryEventKind::Spill, MemoryTag::Checkpoint, bytes, nullptr, {});
}

void MemoryTrace::on_prefetch(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  log(MemoryEventKind::Prefetch, MemoryTag::Checkpoint, bytes, nullptr, {});
}

void MemoryTrace::begin_phase(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  phase_stack_.push_back(name);
  s_.current_phase = name;
  log(MemoryEventKind::PhaseBegin, MemoryTag::Temporary, 0, nullptr, name);
}

void MemoryTrace::end_phase(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!phase_stack_.empty()) phase_stack_.pop_back();
  s_.current_phase = phase_stack_.empty() ? std::string() : phase_stack_.back();
  log(MemoryEventKind::PhaseEnd, MemoryTag::Temporary, 0, nullptr, name);
}

MemorySnapshot MemoryTrace::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return s_;
}

void MemoryTrace::reset_peaks() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& t : s_.tags) t.peak = t.current;
  s_.peak_in_use = s_.in_use;
  s_.peak_reserved = s_.reserved;
  s_.peak_footprint = s_.footprint();
}

void MemoryTrace::set_event_logging(bool on, size_t max_events) {
  std::lock_guard<std::mutex> lock(mu_);
  logging_ = on;
  max_events_ = max_events;
}

std::vector<MemoryEvent> MemoryTrace::events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_;
}

void MemoryTrace::clear_events() {
  std::lock_guard<std::mutex> lock(mu_);
  events_.clear();
}

MemoryTrace& memory_trace(Device device) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, std::unique_ptr<MemoryTrace>> traces;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = traces[{static_cast<int>(device.type), device.index}];
  if (!slot) slot = std::make_unique<MemoryTrace>(device);
  return *slot;
}

PhaseScope::PhaseScope(Device device, std::string name) : device_(device), name_(std::move(name)) {
  memory_trace(device_).begin_phase(name_);
}
PhaseScope::~PhaseScope() { memory_trace(device_).end_phase(name_); }

}  // namespace kestrel
