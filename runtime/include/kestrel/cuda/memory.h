// The CUDA memory runtime's API (no CUDA types): context initialisation, the caching allocator's
// controls and statistics, the pinned host pool, spillable tensors and the offloader. Part of the
// optional `kestrel/cuda/` component, installed only by a CUDA build: defined only when
// KESTREL_WITH_CUDA is 1 (a CPU-only build must not call them).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kestrel/runtime/allocator.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::cuda {

// Initialises device `device` now (it also happens lazily on first use). Idempotent.
// The allocator backend and the rest of the device's settings come from its MemoryConfig
// (kestrel/runtime/memory_config.h: configure_memory, defaults from the environment).
void init(int device = 0);
std::string allocator_backend_name(int device = 0);
AllocatorPolicyStats allocator_stats(int device = 0);
// Returns cached (free) segments to the driver; bytes released.
int64_t release_cached(int device = 0);
void check_allocator_invariants(int device = 0);

// Device free memory (bytes) seen before this process created its CUDA context on `device`
// (NVML; -1 when NVML was unavailable), and cudaMemGetInfo's free memory now.
int64_t free_memory_at_start(int device = 0);
int64_t free_memory_now(int device = 0);
// Re-measures External as the drop in free memory since start minus what the allocator reserved
// (catches lazily loaded modules and library internals). Returns the new External charge.
int64_t refresh_external(int device = 0);

// ---- pinned host pool: page-locked host memory (cudaHostAlloc), cached, with its own limit ----
struct PinnedStats {
  int64_t limit = 0, held = 0, in_use = 0, peak_held = 0, num_host_allocs = 0, num_hits = 0;
};
// A pinned buffer; returned to the pool when destroyed (after the copies recorded on it complete).
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& o) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void* data() const { return ptr_; }
  size_t size() const { return size_; }
  // The buffer is used by work on `stream` (a cudaStream_t): its release waits for that work.
  void record(StreamHandle stream);

 private:
  friend PinnedBuffer pinned_alloc(size_t bytes);
  void* ptr_ = nullptr;
  size_t size_ = 0;
  void* event_ = nullptr;  // cudaEvent_t of the last recorded use
};
PinnedBuffer pinned_alloc(size_t bytes);  // throws when the pool's limit would be crossed
void set_pinned_pool_limit(int64_t bytes);  // default: MemoryConfig::pinned_limit (64 GiB, KESTREL_PINNED_LIMIT)
PinnedStats pinned_stats();
int64_t pinned_release_cached();

// ---- spillable tensors: the budget ladder may move them to the pinned pool under pressure ----
class SpillableTensor {
 public:
  virtual ~SpillableTensor() = default;
  // The tensor on its device (restored from host if it was spilled; blocks until it is back).
  virtual Tensor get() = 0;
  virtual bool spilled() const = 0;
};
// Registers `t` (a contiguous CUDA tensor; the handle should hold the only reference to its storage
// for the spill to free anything).
std::shared_ptr<SpillableTensor> make_spillable(Tensor t);

// ---- recompute offload ----
// Installs (done by init) the autograd offloader for Device::cuda(device): saved region inputs are
// copied to the pinned pool on the D2H stream after forward and prefetched on the H2D stream.
void install_offloader(int device = 0);
struct OffloadStats {
  int64_t offloaded_bytes = 0, restored_bytes = 0, num_offloads = 0;
};
OffloadStats offload_stats(int device = 0);

}  // namespace kestrel::cuda
