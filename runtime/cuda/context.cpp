// The per-device CUDA context: created lazily on first use of a device (or by configure_memory,
// with that config). It owns the compute and copy streams, the cuBLASLt handle and its workspace
// (from the caching allocator, tag Workspace), the device's MemoryConfig (memory_config.h: the
// budget goes to the caching allocator, its one owner; TF32 and the offload bound stay here),
// and measures what the CUDA context and cuBLAS cost on the device (External) as the drop in free
// memory from before the context existed (NVML, no context needed) to after their initialisation.
#include "context.h"

#include <dlfcn.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <mutex>

#include "kestrel/cuda/check.h"
#include "kestrel/runtime/log.h"
#include "kestrel/cuda/context.h"
#include "kestrel/cuda/cublaslt_api.h"
#include "kestrel/cuda/memory.h"
#include "kestrel/runtime/memory_trace.h"

namespace kestrel::cuda {
namespace {

constexpr int kMaxDevices = 64;
constexpr size_t kWorkspaceBytes = 32u << 20;

std::mutex g_mu;
std::array<Context*, kMaxDevices> g_contexts{};  // never destroyed: outlives static destructors
thread_local std::array<cudaStream_t, kMaxDevices> t_stream{};  // StreamGuard overrides

// NVML, loaded at run time (the driver ships it; absent on machines without a GPU).
struct Nvml {
  using InitFn = int (*)();
  using ByPciFn = int (*)(const char*, void**);
  struct Memory {
    unsigned long long total, free, used;
  };
  using MemFn = int (*)(void*, Memory*);
  InitFn init = nullptr;
  ByPciFn by_pci = nullptr;
  MemFn mem = nullptr;
  bool ok = false;
  Nvml() {
    void* h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) return;
    init = reinterpret_cast<InitFn>(dlsym(h, "nvmlInit_v2"));
    by_pci = reinterpret_cast<ByPciFn>(dlsym(h, "nvmlDeviceGetHandleByPciBusId_v2"));
    mem = reinterpret_cast<MemFn>(dlsym(h, "nvmlDeviceGetMemoryInfo"));
    ok = init && by_pci && mem && init() == 0;
  }
};

}  // namespace

int64_t nvml_free_memory(int device) {
  static Nvml nvml;
  if (!nvml.ok) return -1;
  char bus[64] = {0};
  if (cudaDeviceGetPCIBusId(bus, sizeof bus, device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  void* dev = nullptr;
  Nvml::Memory m{};
  if (nvml.by_pci(bus, &dev) != 0 || nvml.mem(dev, &m) != 0) return -1;
  return static_cast<int64_t>(m.free);
}

int Context::device_count() {
  static int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();  // no driver / no device: a CPU-only process, not an error
      return 0;
    }
    return n;
  }();
  return count;
}

Context& Context::get(int device) {
  KESTREL_CHECK(device >= 0 && device < device_count(), "cuda", "device cuda:", device, " does not exist (",
                device_count(), " visible)");
  Context* c = g_contexts[device];
  if (c) return *c;
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_contexts[device]) g_contexts[device] = new Context(device, default_memory_config());
  return *g_contexts[device];
}

Context* Context::find(int device) {
  if (device < 0 || device >= device_count()) return nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  return g_contexts[device];
}

void Context::configure(int device, const MemoryConfig& config) {
  KESTREL_CHECK(device >= 0 && device < device_count(), "cuda", "device cuda:", device, " does not exist (",
                device_count(), " visible)");
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_contexts[device]) {
    g_contexts[device] = new Context(device, config);
    return;
  }
  Context& c = *g_contexts[device];
  KESTREL_CHECK(config.allocator == c.allocator_, "cuda", "memory.allocator: cuda:", device, " was initialised with the ",
                allocator_backend_name(c.allocator_), " allocator and cannot switch to ",
                allocator_backend_name(config.allocator), "; configure the device before its first use");
  c.apply(config);
}

void Context::apply(const MemoryConfig& config) {
  policy_->set_budget(config.budget);
  // A lower budget binds at once: cached segments above it go back to the device (memory in use
  // stays; the next allocation that needs a new segment meets the ladder).
  if (config.budget > 0 && memory_trace(Device::cuda(device_)).snapshot().footprint() > config.budget)
    policy_->release_cached();
  set_pinned_pool_limit(config.pinned_limit);  // one pool per process: the last device configured sets it
  offload_inflight_.store(config.offload_inflight);
  matmul_tf32_.store(config.matmul_tf32);
}

MemoryConfig Context::memory_config() const {
  MemoryConfig c;
  c.budget = policy_->budget();
  c.pinned_limit = pinned_stats().limit;
  c.offload_inflight = offload_inflight();
  c.allocator = allocator_;
  c.matmul_tf32 = matmul_tf32();
  return c;
}

Context::Context(int device, const MemoryConfig& config) : device_(device), allocator_(config.allocator) {
  install_allocators(device_count());
  // Free memory before this process has a context on the device (NVML), then create it.
  int64_t nvml_before = nvml_free_memory(device);
  DeviceGuard guard(device);
  KESTREL_CUDA_CHECK(cudaFree(nullptr));  // creates the primary context
  KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&compute_, cudaStreamNonBlocking));
  KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&h2d_, cudaStreamNonBlocking));
  KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&d2h_, cudaStreamNonBlocking));
  KESTREL_CUBLAS_CHECK(cublaslt_api().Create(&cublaslt_));
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  // NVML and cudaMemGetInfo may differ by a constant (driver reservations): measure both now and
  // express the start in cudaMemGetInfo's terms.
  size_t free_now = 0, total = 0;
  KESTREL_CUDA_CHECK(cudaMemGetInfo(&free_now, &total));
  int64_t nvml_after = nvml_free_memory(device);
  if (nvml_before >= 0 && nvml_after >= 0) {
    free_at_start_ = nvml_before - (nvml_after - static_cast<int64_t>(free_now));
  } else {
    free_at_start_ = static_cast<int64_t>(free_now);
    log_to(LogLevel::Warning, "cuda", "NVML unavailable: the CUDA context's memory on cuda:", device, " is not charged");
  }
  memory_trace(Device::cuda(device)).set_external(free_at_start_ - static_cast<int64_t>(free_now));

  mem_backend_ = allocator_ == AllocatorBackend::Vmm ? make_vmm_backend(device, free_at_start_)
                                                    : make_malloc_backend(device, free_at_start_);
  policy_ = std::make_unique<CachingAllocatorPolicy>(mem_backend_.get(), &memory_trace(Device::cuda(device)),
                                                     Device::cuda(device));
  policy_->set_spill_hook([device](int64_t need) { return spill_for(device, need); });
  apply(config);
  workspace_ = policy_->allocate(kWorkspaceBytes, MemoryTag::Workspace, compute_);
  install_offloader(device);
}

Context::~Context() = default;  // contexts are never destroyed (see g_contexts)

// ---- kernel-side API ----
int current_device() {
  int d = 0;
  KESTREL_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

namespace {
// A device attribute read once per device (up to 64 devices) and cached.
int cached_attribute(cudaDeviceAttr attr, std::atomic<int> (&cache)[64], int device) {
  if (device < 0) device = current_device();
  int n = device < 64 ? cache[device].load(std::memory_order_relaxed) : 0;
  if (n == 0) {
    KESTREL_CUDA_CHECK(cudaDeviceGetAttribute(&n, attr, device));
    if (device < 64) cache[device].store(n, std::memory_order_relaxed);
  }
  return n;
}
}  // namespace

int sm_count(int device) {
  static std::atomic<int> cached[64] = {};
  return cached_attribute(cudaDevAttrMultiProcessorCount, cached, device);
}

int64_t l2_cache_bytes(int device) {
  static std::atomic<int> cached[64] = {};
  return cached_attribute(cudaDevAttrL2CacheSize, cached, device);
}

cudaStream_t current_stream(int device) {
  if (device < 0) device = current_device();
  cudaStream_t s = t_stream[device];
  return s ? s : Context::get(device).compute();
}
cudaStream_t compute_stream(int device) { return Context::get(device < 0 ? current_device() : device).compute(); }
cudaStream_t h2d_stream(int device) { return Context::get(device < 0 ? current_device() : device).h2d(); }
cudaStream_t d2h_stream(int device) { return Context::get(device < 0 ? current_device() : device).d2h(); }
cublasLtHandle_t cublaslt_handle(int device) {
  return Context::get(device < 0 ? current_device() : device).cublaslt();
}
void* cublaslt_workspace(size_t* bytes, int device) {
  return Context::get(device < 0 ? current_device() : device).workspace(bytes);
}
bool matmul_tf32(int device) { return Context::get(device < 0 ? current_device() : device).matmul_tf32(); }

DeviceGuard::DeviceGuard(int device) : saved_(current_device()) {
  if (device != saved_) KESTREL_CUDA_CHECK(cudaSetDevice(device));
}
DeviceGuard::~DeviceGuard() {
  int now = -1;
  cudaGetDevice(&now);
  if (now != saved_) KESTREL_CUDA_CHECK_NOTHROW(cudaSetDevice(saved_));
}

StreamGuard::StreamGuard(cudaStream_t stream, int device)
    : device_(device < 0 ? current_device() : device), saved_(t_stream[device_]) {
  t_stream[device_] = stream;
}
StreamGuard::~StreamGuard() { t_stream[device_] = saved_; }

Event::Event() { KESTREL_CUDA_CHECK(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming)); }
Event::~Event() { KESTREL_CUDA_CHECK_NOTHROW(cudaEventDestroy(e_)); }

void stream_wait(cudaStream_t waiter, cudaStream_t producer) {
  if (waiter == producer) return;
  cudaEvent_t e;
  KESTREL_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  KESTREL_CUDA_CHECK(cudaEventRecord(e, producer));
  KESTREL_CUDA_CHECK(cudaStreamWaitEvent(waiter, e, 0));
  KESTREL_CUDA_CHECK(cudaEventDestroy(e));  // released once the wait has been satisfied
}

// ---- public controls (cuda_memory.h) ----
void init(int device) { (void)Context::get(device); }
std::string allocator_backend_name(int device) { return Context::get(device).memory_backend().name(); }
AllocatorPolicyStats allocator_stats(int device) { return Context::get(device).policy().stats(); }
int64_t release_cached(int device) { return Context::get(device).policy().release_cached(); }
void check_allocator_invariants(int device) { Context::get(device).policy().check_invariants(); }
int64_t free_memory_at_start(int device) { return Context::get(device).free_at_start(); }
int64_t free_memory_now(int device) {
  DeviceGuard g(device);
  size_t f = 0, t = 0;
  KESTREL_CUDA_CHECK(cudaMemGetInfo(&f, &t));
  return static_cast<int64_t>(f);
}
int64_t refresh_external(int device) { return remeasure_external(device, Context::get(device).free_at_start()); }

int64_t remeasure_external(int device, int64_t free_at_start) {
  DeviceGuard g(device);
  size_t f = 0, t = 0;
  KESTREL_CUDA_CHECK(cudaMemGetInfo(&f, &t));
  MemoryTrace& tr = memory_trace(Device::cuda(device));
  int64_t ext = free_at_start - static_cast<int64_t>(f) - tr.snapshot().reserved;
  if (ext < 0) ext = 0;
  tr.set_external(ext);
  return ext;
}

}  // namespace kestrel::cuda
