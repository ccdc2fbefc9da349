// CudaCachingAllocator: the kestrel::Allocator installed for every CUDA device. Creating it is
// cheap (no CUDA call); the first allocation initialises the device's Context, whose
// CachingAllocatorPolicy (pools, split/merge, streams, budget ladder) serves every request.
// A request without a stream belongs to the thread's current stream (cuda::current_stream).
#include <array>
#include <memory>
#include <mutex>

#include "context.h"
#include "kestrel/cuda/context.h"

namespace kestrel::cuda {
namespace {

class CudaCachingAllocator final : public Allocator {
 public:
  explicit CudaCachingAllocator(int device) : device_(device) {}
  Allocation allocate(size_t bytes, MemoryTag tag, StreamHandle stream) override {
    Context& c = Context::get(device_);
    if (!stream) stream = current_stream(device_);
    return c.policy().allocate(bytes, tag, stream);
  }
  void deallocate(const Allocation& a) override { Context::get(device_).policy().deallocate(a); }
  void record_stream(const Allocation& a, StreamHandle stream) override {
    Context::get(device_).policy().record_stream(a, stream);
  }
  Device device() const override { return Device::cuda(device_); }
  int64_t release_cached() override { return Context::get(device_).policy().release_cached(); }

 private:
  int device_;
};

}  // namespace

void install_allocators(int count) {
  static std::once_flag once;
  static std::vector<std::unique_ptr<CudaCachingAllocator>> allocators;
  std::call_once(once, [count] {
    for (int i = 0; i < count; ++i) {
      allocators.push_back(std::make_unique<CudaCachingAllocator>(i));
      set_allocator(Device::cuda(i), allocators.back().get());
    }
  });
}

}  // namespace kestrel::cuda
