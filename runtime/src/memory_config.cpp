// MemoryConfig: validation, the allocator backend's names, and the push into a device's backend
// (the CUDA context owns what it is given; memory_config.h). set_memory_budget / memory_budget are
// the budget alone through the same path.
#include "kestrel/runtime/memory_config.h"

#include "backend.h"
#include "kestrel/runtime/error.h"
#include "kestrel/runtime/memory_budget.h"

namespace kestrel {

std::string_view allocator_backend_name(AllocatorBackend backend) {
  return backend == AllocatorBackend::Vmm ? "vmm" : "malloc";
}

AllocatorBackend parse_allocator_backend(std::string_view text, std::string_view what) {
  if (text == "vmm") return AllocatorBackend::Vmm;
  if (text == "malloc") return AllocatorBackend::Malloc;
  throw make_error("memory", what, ": expected vmm or malloc, got '", text, "'");
}

void MemoryConfig::validate(std::string_view what) const {
  KESTREL_CHECK(budget >= 0, "memory", what, ".budget must be >= 0 (0 = none), got ", budget);
  KESTREL_CHECK(pinned_limit > 0, "memory", what, ".pinned_limit must be positive, got ", pinned_limit);
  KESTREL_CHECK(offload_inflight > 0, "memory", what, ".offload_inflight must be positive, got ", offload_inflight);
}

void configure_memory(Device device, const MemoryConfig& config) {
  config.validate();
  KESTREL_CHECK(device.is_cuda(), "memory", "memory settings apply to CUDA devices; ", device.str(),
                " has no budget, pinned pool or offloader");
  detail::cuda_backend().configure_memory(device.index, config);
}

MemoryConfig memory_config(Device device) {
  if (!device.is_cuda() || cuda_device_count() == 0) return default_memory_config();
  return detail::cuda_backend().memory_config(device.index);
}

void set_memory_budget(Device device, int64_t bytes) {
  MemoryConfig c = memory_config(device);
  c.budget = bytes > 0 ? bytes : 0;
  configure_memory(device, c);
}

int64_t memory_budget(Device device) { return device.is_cuda() ? memory_config(device).budget : 0; }

}  // namespace kestrel
