// Device descriptions (device_info.h): the CPU's is empty; a CUDA device's properties come from the
// CUDA backend once per device, the bf16 peak from the table below.
#include "kestrel/runtime/device_info.h"

#include <map>
#include <mutex>

#include "backend.h"

namespace kestrel {

double peak_bf16_flops_per_sm(int compute_major, int compute_minor) {
  if (compute_major == 8 && compute_minor == 0) return 312e12 / 108;
  if (compute_major == 9 && compute_minor == 0) return 989e12 / 132;
  if (compute_major == 10 && compute_minor == 0) return 2250e12 / 148;
  return 0.0;
}

DeviceInfo device_info(Device device) {
  if (!device.is_cuda()) {
    DeviceInfo cpu;
    cpu.name = "cpu";
    return cpu;
  }
  static std::mutex mu;
  static std::map<int, DeviceInfo> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device.index);
  if (it == cache.end()) {
    DeviceInfo info = detail::cuda_backend().device_info(device.index);
    info.peak_bf16_flops = peak_bf16_flops_per_sm(info.compute_major, info.compute_minor) * info.sm_count;
    it = cache.emplace(device.index, std::move(info)).first;
  }
  return it->second;
}

}  // namespace kestrel
