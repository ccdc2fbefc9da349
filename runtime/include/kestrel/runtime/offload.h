// Moving a saved tensor off its device and back, per device: the interface the recompute regions
// of autograd use and the device runtimes implement. It lives in runtime (below autograd) because
// a device implements it: the CUDA runtime installs one that copies to the pinned host pool on the
// D2H stream and prefetches on the H2D stream (runtime/cuda/offloader.cpp). A device without an
// installed offloader (the CPU) keeps the tensor where it is.
#pragma once

#include <functional>
#include <memory>

#include "kestrel/runtime/tensor.h"

namespace kestrel {

class OffloadHandle {
 public:
  virtual ~OffloadHandle() = default;
  virtual void prefetch() = 0;  // start bringing it back (asynchronous)
  virtual Tensor get() = 0;     // the tensor on its original device (waits for the copy)
};
using Offloader = std::function<std::unique_ptr<OffloadHandle>(const Tensor&)>;

// Installs (or, with an empty function, removes) the offloader of `device`.
void set_offloader(Device device, Offloader offloader);
// A handle holding `t` through its device's offloader, or in place when there is none.
std::unique_ptr<OffloadHandle> offload(const Tensor& t);
// A handle that keeps `t` where it is, whatever the device.
std::unique_ptr<OffloadHandle> keep_in_place(const Tensor& t);

}  // namespace kestrel
