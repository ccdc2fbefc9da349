// Caller-supplied device and stream for embedding applications, without CUDA types: an application
// that owns its CUDA streams hands one to Kestrel as an opaque StreamHandle (a cudaStream_t cast to
// void*), and every op this thread issues on that device inside the scope — including a whole
// Trainer::run() or a model's forward/backward — launches on it, and its allocations belong to that
// stream in the caching allocator (stream-aware reuse). The kernel-side equivalents with CUDA types
// are kestrel::cuda::DeviceGuard / StreamGuard in cuda_context.h.
//
// On the CPU both scopes are no-ops (a non-null stream for a CPU device is an error). A CUDA device in
// a build without CUDA is an error (kestrel::Error), never a crash.
#pragma once

#include <memory>

#include "kestrel/runtime/device.h"

namespace kestrel {

// Makes `device` the current CUDA device of this thread for the scope (restored on exit).
class DeviceScope {
 public:
  explicit DeviceScope(Device device);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Runs this thread's ops on `device` on `stream` for the scope (nullptr: the device's own compute
// stream). The caller keeps the stream alive until the work and the scope are done; to hand results
// back to other streams, synchronise the stream or record an event on it.
class StreamScope {
 public:
  StreamScope(Device device, StreamHandle stream);
  ~StreamScope();
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The stream ops on `device` issued by this thread launch on now (nullptr on the CPU).
StreamHandle current_stream(Device device);

}  // namespace kestrel
