// Private: the per-device CUDA context (streams, cuBLASLt, allocator, external-memory baseline).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <atomic>
#include <memory>
#include <mutex>

#include "kestrel/runtime/allocator.h"
#include "src/caching_allocator_policy.h"
#include "kestrel/runtime/memory_config.h"

namespace kestrel::cuda {

class Context {
 public:
  // The device's context, created on first use (thread-safe) with default_memory_config().
  static Context& get(int device);
  // Pushes `config` into the device's context, creating it with it when it does not exist yet.
  static void configure(int device, const MemoryConfig& config);
  // The context when it exists, else nullptr (never creates one).
  static Context* find(int device);
  // Number of visible devices; 0 (never a crash) without a driver or GPU.
  static int device_count();

  int device() const { return device_; }
  cudaStream_t compute() const { return compute_; }
  cudaStream_t h2d() const { return h2d_; }
  cudaStream_t d2h() const { return d2h_; }
  cublasLtHandle_t cublaslt() const { return cublaslt_; }
  void* workspace(size_t* bytes) const {
    *bytes = workspace_.bytes;
    return workspace_.ptr;
  }
  CachingAllocatorPolicy& policy() { return *policy_; }
  DeviceMemoryBackend& memory_backend() { return *mem_backend_; }
  int64_t free_at_start() const { return free_at_start_; }
  // The settings the context runs with (the budget read back from the allocator, its owner).
  MemoryConfig memory_config() const;
  bool matmul_tf32() const { return matmul_tf32_.load(std::memory_order_relaxed); }
  int64_t offload_inflight() const { return offload_inflight_.load(std::memory_order_relaxed); }

  Context(int device, const MemoryConfig& config);
  ~Context();

 private:
  int device_;
  cudaStream_t compute_ = nullptr, h2d_ = nullptr, d2h_ = nullptr;
  cublasLtHandle_t cublaslt_ = nullptr;
  std::unique_ptr<DeviceMemoryBackend> mem_backend_;
  std::unique_ptr<CachingAllocatorPolicy> policy_;
  Allocation workspace_;
  int64_t free_at_start_ = -1;
  AllocatorBackend allocator_ = AllocatorBackend::Vmm;
  std::atomic<bool> matmul_tf32_{false};
  std::atomic<int64_t> offload_inflight_{0};

  void apply(const MemoryConfig& config);  // everything but the allocator backend
};

// Device memory backends (device_memory_backends.cpp).
// `free_at_start`: cudaMemGetInfo-equivalent free memory before the context existed; before_map()
// re-charges External as free_at_start - free now - reserved.
std::unique_ptr<DeviceMemoryBackend> make_vmm_backend(int device, int64_t free_at_start);
std::unique_ptr<DeviceMemoryBackend> make_malloc_backend(int device, int64_t free_at_start);
int64_t remeasure_external(int device, int64_t free_at_start);
// NVML free memory of a device (by CUDA ordinal) without creating a context; -1 if unavailable.
int64_t nvml_free_memory(int device);
// The offloader/spill machinery (offloader.cpp).
int64_t spill_for(int device, int64_t bytes_needed);
// The caching allocator installed for every CUDA device (cuda_allocator.cpp); creating it is cheap.
void install_allocators(int count);

}  // namespace kestrel::cuda
