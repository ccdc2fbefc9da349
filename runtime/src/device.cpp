// Device parsing and the CUDA backend registry.
#include <atomic>

#include "backend.h"
#include "kestrel/runtime/device.h"
#include "kestrel/runtime/error.h"

namespace kestrel {
namespace detail {
namespace {
std::atomic<DeviceBackend*> g_cuda{nullptr};
}
void register_cuda_backend(DeviceBackend* backend) { g_cuda.store(backend); }
bool has_cuda_backend() { return g_cuda.load() != nullptr; }
DeviceBackend& cuda_backend() {
  DeviceBackend* b = g_cuda.load();
  KESTREL_CHECK(b != nullptr, "device",
                KESTREL_WITH_CUDA ? "CUDA backend not initialised"
                                  : "Kestrel was built without CUDA; rebuild with -DKESTREL_CUDA=ON to use a GPU");
  KESTREL_CHECK(b->device_count() > 0, "device", "no CUDA device is visible to this process (check the driver, "
                "CUDA_VISIBLE_DEVICES, or run on the CPU with device=cpu)");
  return *b;
}
}  // namespace detail

Device parse_device(const std::string& s) {
  if (s == "cpu") return Device::cpu();
  if (s == "cuda" || s == "gpu") return Device::cuda(0);
  if (s.rfind("cuda:", 0) == 0) {
    try {
      size_t pos = 0;
      int idx = std::stoi(s.substr(5), &pos);
      if (pos == s.size() - 5 && idx >= 0) return Device::cuda(idx);
    } catch (...) {
    }
  }
  throw make_error("device", "cannot parse device '", s, "'; expected cpu, cuda or cuda:N");
}

int cuda_device_count() { return detail::has_cuda_backend() ? detail::g_cuda.load()->device_count() : 0; }
bool cuda_available() { return cuda_device_count() > 0; }

}  // namespace kestrel
