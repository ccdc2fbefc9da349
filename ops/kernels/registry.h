// Private: device dispatch for op kernels.
//
// Each kernel has one slot per device type; cpu/<family>.cpp and cuda/<family>.cu fill the slots
// at load time with KESTREL_REGISTER_KERNEL. The op's public function (src/<family>.cpp) validates
// its arguments once and calls dispatch(slot, "op", device, args...). Adding a device kernel for an
// existing op touches only that device's file; a missing one fails with a clear error.
#pragma once

#include <utility>

#include "kestrel/runtime/device.h"
#include "kestrel/runtime/error.h"
#include "kestrel/runtime/op_profile.h"

namespace kestrel::kernels {

template <typename Fn>
struct KernelSlot {
  Fn* cpu = nullptr;
  Fn* cuda = nullptr;
};

template <typename Fn, typename... Args>
decltype(auto) dispatch(const KernelSlot<Fn>& slot, const char* op, Device device, Args&&... args) {
  Fn* f = device.is_cuda() ? slot.cuda : slot.cpu;
  KESTREL_CHECK(f != nullptr, op, "no ", device.is_cuda() ? "CUDA" : "CPU", " kernel",
                device.is_cuda() && !KESTREL_WITH_CUDA ? " (Kestrel was built without CUDA)" : "");
  OpProfile::Bracket timed(op, device);  // kestrel/runtime/op_profile.h: nothing unless one records
  return f(std::forward<Args>(args)...);
}

struct Registrar {
  template <typename F>
  explicit Registrar(F&& f) {
    f();
  }
};

}  // namespace kestrel::kernels

#define KESTREL_KERNEL_CONCAT2(a, b) a##b
#define KESTREL_KERNEL_CONCAT(a, b) KESTREL_KERNEL_CONCAT2(a, b)
// KESTREL_REGISTER_KERNEL(slot, cpu, fn) in a kernel file: slot.cpu = fn at load time.
#define KESTREL_REGISTER_KERNEL(slot, device, fn)                                       \
  static ::kestrel::kernels::Registrar KESTREL_KERNEL_CONCAT(kestrel_reg_, __LINE__)( \
      [] { ::kestrel::kernels::slot.device = fn; })
