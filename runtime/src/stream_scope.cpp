// DeviceScope / StreamScope / current_stream (stream_scope.h): thin CUDA-free wrappers over
// kestrel::cuda::DeviceGuard and StreamGuard, compiled to argument checks in CPU-only builds.
#include "kestrel/runtime/stream_scope.h"

#include "kestrel/runtime/error.h"
#if KESTREL_WITH_CUDA
#include "kestrel/cuda/context.h"
#endif

namespace kestrel {

namespace {
void check_cuda_device(Device device, const char* what) {
  KESTREL_CHECK(device.index >= 0, what, "negative device index in ", device.str());
#if KESTREL_WITH_CUDA
  KESTREL_CHECK(device.index < cuda_device_count(), what, device.str(), " is not available (",
                cuda_device_count(), " CUDA devices visible)");
#else
  KESTREL_CHECK(false, what, device.str(), " requested but this libkestrel was built without CUDA");
#endif
}
}  // namespace

#if KESTREL_WITH_CUDA
struct DeviceScope::Impl {
  cuda::DeviceGuard guard;
  explicit Impl(int d) : guard(d) {}
};
struct StreamScope::Impl {
  cuda::DeviceGuard device;  // the stream's device is current while the scope runs
  cuda::StreamGuard stream;
  Impl(int d, StreamHandle s) : device(d), stream(static_cast<cudaStream_t>(s), d) {}
};
#else
struct DeviceScope::Impl {};
struct StreamScope::Impl {};
#endif

DeviceScope::DeviceScope(Device device) {
  if (device.is_cpu()) return;
  check_cuda_device(device, "device_scope");
#if KESTREL_WITH_CUDA
  impl_ = std::make_unique<Impl>(device.index);
#endif
}
DeviceScope::~DeviceScope() = default;

StreamScope::StreamScope(Device device, StreamHandle stream) {
  if (device.is_cpu()) {
    KESTREL_CHECK(stream == nullptr, "stream_scope", "a CPU device takes no stream (got a non-null handle)");
    return;
  }
  check_cuda_device(device, "stream_scope");
#if KESTREL_WITH_CUDA
  impl_ = std::make_unique<Impl>(device.index, stream);
#endif
}
StreamScope::~StreamScope() = default;

StreamHandle current_stream(Device device) {
  if (device.is_cpu()) return nullptr;
  check_cuda_device(device, "current_stream");
#if KESTREL_WITH_CUDA
  return static_cast<StreamHandle>(cuda::current_stream(device.index));
#else
  return nullptr;
#endif
}

}  // namespace kestrel
