// The two real DeviceMemoryBackends of the caching allocator:
// - VMM (default): each segment is an address range from cuMemAddressReserve backed by one
//   cuMemCreate allocation of whole granules (2 MiB on H200) and unmapped (cuMemUnmap +
//   cuMemAddressFree) when released, so the device footprint moves exactly with the reservation.
// - malloc: cudaMalloc/cudaFree per segment (selectable with KESTREL_CUDA_ALLOCATOR=malloc).
// Both order streams with events and re-measure External before a new segment is budgeted.
// Driver functions are looked up through cudart (cudaGetDriverEntryPointByVersion), so libkestrel
// does not link libcuda.so.1 and loads on machines without a driver (device_count() is then 0).
#include <cuda.h>

#include "context.h"
#include "kestrel/cuda/check.h"
#include "kestrel/cuda/context.h"

namespace kestrel::cuda {
namespace {

template <typename F>
F driver_fn(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q{};
  KESTREL_CUDA_CHECK(cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q));
  KESTREL_CHECK(p && q == cudaDriverEntryPointSuccess, "cuda", "driver function ", name, " not found");
  return reinterpret_cast<F>(p);
}

// The virtual-memory subset of the driver API.
struct Driver {
  decltype(&cuMemGetAllocationGranularity) granularity = driver_fn<decltype(granularity)>("cuMemGetAllocationGranularity");
  decltype(&cuMemAddressReserve) reserve = driver_fn<decltype(reserve)>("cuMemAddressReserve");
  decltype(&cuMemAddressFree) address_free = driver_fn<decltype(address_free)>("cuMemAddressFree");
  decltype(&cuMemCreate) create = driver_fn<decltype(create)>("cuMemCreate");
  decltype(&cuMemRelease) release = driver_fn<decltype(release)>("cuMemRelease");
  decltype(&cuMemMap) map = driver_fn<decltype(map)>("cuMemMap");
  decltype(&cuMemUnmap) unmap = driver_fn<decltype(unmap)>("cuMemUnmap");
  decltype(&cuMemSetAccess) set_access = driver_fn<decltype(set_access)>("cuMemSetAccess");
  decltype(&cuGetErrorString) error_string = driver_fn<decltype(error_string)>("cuGetErrorString");
};
const Driver& drv() {
  static Driver d;
  return d;
}

#define KESTREL_DRV(expr)                                                                              \
  do {                                                                                                 \
    CUresult r_ = (expr);                                                                              \
    if (r_ != CUDA_SUCCESS) {                                                                          \
      const char* m_ = nullptr;                                                                        \
      drv().error_string(r_, &m_);                                                                     \
      throw make_error("cuda-driver", #expr, " failed: ", m_ ? m_ : "unknown", " (", __FILE__, ":", __LINE__, ")"); \
    }                                                                                                  \
  } while (0)

class CudaBackendBase : public DeviceMemoryBackend {
 public:
  CudaBackendBase(int device, int64_t free_at_start) : device_(device), free_at_start_(free_at_start) {}
  void stream_wait_stream(StreamHandle waiter, StreamHandle producer) override {
    stream_wait(static_cast<cudaStream_t>(waiter), static_cast<cudaStream_t>(producer));
  }
  EventHandle record_event(StreamHandle stream) override {
    cudaEvent_t e;
    KESTREL_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    KESTREL_CUDA_CHECK(cudaEventRecord(e, static_cast<cudaStream_t>(stream)));
    return e;
  }
  bool event_done(EventHandle e) override {
    cudaError_t r = cudaEventQuery(static_cast<cudaEvent_t>(e));
    if (r == cudaErrorNotReady) return false;
    KESTREL_CUDA_CHECK(r);
    return true;
  }
  void event_sync(EventHandle e) override { KESTREL_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(e))); }
  void destroy_event(EventHandle e) override { KESTREL_CUDA_CHECK_NOTHROW(cudaEventDestroy(static_cast<cudaEvent_t>(e))); }
  void before_map() override { remeasure_external(device_, free_at_start_); }

 protected:
  int device_;
  int64_t free_at_start_;
};

class VmmBackend final : public CudaBackendBase {
 public:
  VmmBackend(int device, int64_t free_at_start) : CudaBackendBase(device, free_at_start) {
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = device;
    KESTREL_DRV(drv().granularity(&granularity_, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    access_.location = prop_.location;
    access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  std::string name() const override { return "vmm"; }
  size_t granularity() const override { return granularity_; }
  void* map_segment(size_t bytes) override {
    CUdeviceptr ptr = 0;
    KESTREL_DRV(drv().reserve(&ptr, bytes, granularity_, 0, 0));
    CUmemGenericAllocationHandle h;
    CUresult r = drv().create(&h, bytes, &prop_, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {
      drv().address_free(ptr, bytes);
      return nullptr;
    }
    KESTREL_DRV(r);
    KESTREL_DRV(drv().map(ptr, bytes, 0, h, 0));
    KESTREL_DRV(drv().release(h));  // the mapping keeps the physical memory alive
    KESTREL_DRV(drv().set_access(ptr, bytes, &access_, 1));
    return reinterpret_cast<void*>(ptr);
  }
  void unmap_segment(void* base, size_t bytes) override {
    // The policy has already waited for the streams that used this segment (not the whole device).
    DeviceGuard g(device_);
    KESTREL_DRV(drv().unmap(reinterpret_cast<CUdeviceptr>(base), bytes));
    KESTREL_DRV(drv().address_free(reinterpret_cast<CUdeviceptr>(base), bytes));
  }

 private:
  CUmemAllocationProp prop_{};
  CUmemAccessDesc access_{};
  size_t granularity_ = 2u << 20;
};

class MallocBackend final : public CudaBackendBase {
 public:
  using CudaBackendBase::CudaBackendBase;
  std::string name() const override { return "malloc"; }
  size_t granularity() const override { return 2u << 20; }
  void* map_segment(size_t bytes) override {
    DeviceGuard g(device_);
    void* p = nullptr;
    cudaError_t r = cudaMalloc(&p, bytes);
    if (r == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      return nullptr;
    }
    KESTREL_CUDA_CHECK(r);
    return p;
  }
  void unmap_segment(void* base, size_t bytes) override {
    DeviceGuard g(device_);
    KESTREL_CUDA_CHECK(cudaFree(base));  // synchronises the device
  }
};

}  // namespace

std::unique_ptr<DeviceMemoryBackend> make_vmm_backend(int device, int64_t free_at_start) {
  return std::make_unique<VmmBackend>(device, free_at_start);
}
std::unique_ptr<DeviceMemoryBackend> make_malloc_backend(int device, int64_t free_at_start) {
  return std::make_unique<MallocBackend>(device, free_at_start);
}

}  // namespace kestrel::cuda
