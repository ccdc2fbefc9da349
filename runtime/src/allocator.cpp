// The CPU allocator (64-byte aligned malloc, counted by tag) and the per-device allocator registry.
#include "kestrel/runtime/allocator.h"

#include <cstdlib>
#include <map>
#include <mutex>
#include <new>

#include "kestrel/runtime/error.h"
#include "kestrel/runtime/memory_trace.h"

namespace kestrel {
namespace {

class CpuAllocator final : public Allocator {
 public:
  Allocation allocate(size_t bytes, MemoryTag tag, StreamHandle) override {
    size_t rounded = (bytes + 63) / 64 * 64;
    void* p = rounded ? std::aligned_alloc(64, rounded) : nullptr;
    if (rounded && !p)
      throw make_error("cpu-allocator", "out of host memory allocating ", bytes, " bytes for tag ",
                       tag_name(tag));
    memory_trace(Device::cpu()).on_alloc(tag, static_cast<int64_t>(bytes), p);
    return Allocation{p, bytes, tag, Device::cpu(), nullptr, nullptr};
  }
  void deallocate(const Allocation& a) override {
    memory_trace(Device::cpu()).on_free(a.tag, static_cast<int64_t>(a.bytes), a.ptr);
    std::free(a.ptr);
  }
  Device device() const override { return Device::cpu(); }
};

struct Registry {
  std::mutex mu;
  std::map<std::pair<int, int>, Allocator*> by_device;
};
Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

Allocator& allocator_for(Device device) {
  static CpuAllocator cpu;
  if (device.is_cpu()) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.by_device.find({0, 0});
    return it != r.by_device.end() ? *it->second : cpu;
  }
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.by_device.find({static_cast<int>(device.type), device.index});
  KESTREL_CHECK(it != r.by_device.end(), "allocator",
                "no allocator for ", device.str(),
                KESTREL_WITH_CUDA ? " (is a CUDA device present? call kestrel::cuda::init)"
                                  : " (Kestrel was built without CUDA; rebuild with -DKESTREL_CUDA=ON)");
  return *it->second;
}

Allocator* installed_allocator(Device device) {
  if (device.is_cpu()) return &allocator_for(device);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.by_device.find({static_cast<int>(device.type), device.index});
  return it == r.by_device.end() ? nullptr : it->second;
}

void set_allocator(Device device, Allocator* allocator) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto key = std::make_pair(static_cast<int>(device.type), device.index);
  if (allocator)
    r.by_device[key] = allocator;
  else
    r.by_device.erase(key);
}

}  // namespace kestrel
