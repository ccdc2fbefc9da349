#include "kestrel/runtime/op_profile.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <set>

#include "backend.h"
#include "kestrel/runtime/error.h"

namespace kestrel {
namespace {

std::atomic<OpProfile*> g_recording{nullptr};
thread_local int t_depth = 0;  // dispatch brackets open on this thread

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

OpProfile* OpProfile::recording() noexcept { return g_recording.load(std::memory_order_acquire); }

OpProfile::~OpProfile() {
  OpProfile* self = this;
  g_recording.compare_exchange_strong(self, nullptr);
  release();
}

void OpProfile::start() {
  KESTREL_CHECK(!started_, "op-profile", "start: this profile already recorded; use a new one");
  OpProfile* none = nullptr;
  owner_ = std::this_thread::get_id();  // before publishing: a bracket reads it once it sees this profile
  KESTREL_CHECK(g_recording.compare_exchange_strong(none, this), "op-profile",
                "start: another OpProfile is recording (one at a time per process)");
  started_ = true;
}

size_t OpProfile::begin(const char* op, Device device) {
  Mark m{op, device};
  if (device.is_cuda())
    m.begin = detail::cuda_backend().record_timestamp(device.index);
  else
    m.host_start_ns = now_ns();
  std::lock_guard<std::mutex> g(mu_);
  marks_.push_back(m);
  return marks_.size() - 1;
}

void OpProfile::end(size_t mark) {
  std::unique_lock<std::mutex> g(mu_);
  Mark m = marks_[mark];
  g.unlock();
  void* e = nullptr;
  double host_ms = -1;
  if (m.device.is_cuda())
    e = detail::cuda_backend().record_timestamp(m.device.index);
  else
    host_ms = static_cast<double>(now_ns() - m.host_start_ns) / 1e6;
  g.lock();
  marks_[mark].end = e;
  marks_[mark].host_ms = host_ms;
}

void OpProfile::stop() {
  OpProfile* self = this;
  KESTREL_CHECK(g_recording.compare_exchange_strong(self, nullptr), "op-profile", "stop: this profile is not recording");
  std::lock_guard<std::mutex> g(mu_);
  std::set<int> devices;
  for (const Mark& m : marks_)
    if (m.device.is_cuda()) devices.insert(m.device.index);
  for (int d : devices) detail::cuda_backend().synchronize(Device::cuda(d));
  std::map<std::string, OpTime> by_op;
  for (const Mark& m : marks_) {
    OpTime& t = by_op[m.op];
    t.op = m.op;
    ++t.calls;
    if (m.device.is_cuda()) {
      if (m.begin && m.end) t.ms += detail::cuda_backend().elapsed_ms(m.begin, m.end);
    } else if (m.host_ms >= 0) {
      t.ms += m.host_ms;
    }
  }
  ops_.clear();
  for (auto& [name, t] : by_op) ops_.push_back(t);
  std::sort(ops_.begin(), ops_.end(), [](const OpTime& a, const OpTime& b) { return a.ms > b.ms; });
  for (Mark& m : marks_) {
    for (void* e : {m.begin, m.end})
      if (e) detail::cuda_backend().release_timestamp(e);
    m.begin = m.end = nullptr;
  }
  marks_.clear();
}

void OpProfile::release() {
  std::lock_guard<std::mutex> g(mu_);
  for (Mark& m : marks_)
    for (void* e : {m.begin, m.end})
      if (e) detail::cuda_backend().release_timestamp(e);
  marks_.clear();
}

double OpProfile::total_ms() const {
  double s = 0;
  for (const OpTime& t : ops_) s += t.ms;
  return s;
}

OpProfile::Bracket::Bracket(const char* op, Device device) {
  OpProfile* p = OpProfile::recording();
  if (!p || std::this_thread::get_id() != p->owner_) return;
  counted_ = true;
  if (t_depth++ > 0) return;  // inside another op's bracket: its time is that op's
  profile_ = p;
  mark_ = p->begin(op, device);
}

OpProfile::Bracket::~Bracket() {
  if (!counted_) return;
  --t_depth;
  if (profile_) {
    try {
      profile_->end(mark_);
    } catch (...) {  // a failing timestamp loses one interval, never the op's own result or error
    }
  }
}

}  // namespace kestrel
