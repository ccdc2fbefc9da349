// The per-device offloader registry (see offload.h).
#include "kestrel/runtime/offload.h"

#include <map>
#include <mutex>
#include <utility>

namespace kestrel {
namespace {

// Keeps the tensor where it is (CPU tensors, and any device without an installed offloader).
class KeepHandle final : public OffloadHandle {
 public:
  explicit KeepHandle(Tensor t) : t_(std::move(t)) {}
  void prefetch() override {}
  Tensor get() override { return t_; }

 private:
  Tensor t_;
};

std::mutex g_mu;
std::map<std::pair<int, int>, Offloader>& offloaders() {
  static std::map<std::pair<int, int>, Offloader> m;
  return m;
}

}  // namespace

void set_offloader(Device device, Offloader offloader) {
  std::lock_guard<std::mutex> lock(g_mu);
  offloaders()[{static_cast<int>(device.type), device.index}] = std::move(offloader);
}

std::unique_ptr<OffloadHandle> offload(const Tensor& t) {
  Offloader f;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = offloaders().find({static_cast<int>(t.device().type), t.device().index});
    if (it != offloaders().end()) f = it->second;
  }
  return f ? f(t) : keep_in_place(t);
}

std::unique_ptr<OffloadHandle> keep_in_place(const Tensor& t) { return std::make_unique<KeepHandle>(t); }

}  // namespace kestrel
