// The CUDA DeviceBackend (runtime/src/backend.h), registered when libkestrel loads. Registration
// makes no CUDA call; device_count() asks the runtime once and answers 0 without a driver or GPU.
// Copies are ordered on the current (compute) stream; copies to the host are complete on return,
// and so are copies from the host (the source may be a temporary).
#include "src/backend.h"
#include "context.h"
#include "copy_kernels.h"
#include "kestrel/cuda/check.h"
#include "kestrel/cuda/context.h"

namespace kestrel::cuda {
namespace {

class CudaDeviceBackend final : public detail::DeviceBackend {
 public:
  int device_count() override {
    int n = Context::device_count();
    if (n > 0) install_allocators(n);
    return n;
  }

  void copy_bytes(void* dst, Device dd, const void* src, Device sd, size_t bytes) override {
    if (bytes == 0) return;
    if (dd.is_cuda() && sd.is_cuda() && dd.index != sd.index) {
      KESTREL_CUDA_CHECK(cudaStreamSynchronize(current_stream(sd.index)));
      cudaStream_t s = current_stream(dd.index);
      KESTREL_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dd.index, src, sd.index, bytes, s));
      KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
      return;
    }
    int dev = dd.is_cuda() ? dd.index : sd.index;
    DeviceGuard g(dev);
    cudaStream_t s = current_stream(dev);
    cudaMemcpyKind kind = dd.is_cuda() ? (sd.is_cuda() ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                                       : cudaMemcpyDeviceToHost;
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, s));
    if (kind != cudaMemcpyDeviceToDevice) KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
  }

  void strided_copy(const Tensor& dst, const Tensor& src) override { launch_strided_copy(dst, src); }
  void fill(const Tensor& dst, double value) override { launch_fill(dst, value); }
  void add_into(const Tensor& dst, const Tensor& src) override { launch_add_into(dst, src); }
  void synchronize(Device device) override {
    DeviceGuard g(device.index);
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  }
  void fill_random(const Tensor& dst, bool normal, uint64_t seed, uint64_t offset, double a, double b) override {
    launch_fill_random(dst, normal, seed, offset, a, b);
  }

  DeviceInfo device_info(int index) override {
    cudaDeviceProp prop{};
    KESTREL_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
    DeviceInfo info;
    info.name = prop.name;
    info.sm_count = prop.multiProcessorCount;
    info.compute_major = prop.major;
    info.compute_minor = prop.minor;
    info.total_memory = static_cast<int64_t>(prop.totalGlobalMem);
    return info;
  }

  void configure_memory(int index, const MemoryConfig& config) override { Context::configure(index, config); }
  void* record_timestamp(int index) override {
    DeviceGuard g(index);
    cudaEvent_t e = nullptr;
    KESTREL_CUDA_CHECK(cudaEventCreate(&e));
    KESTREL_CUDA_CHECK(cudaEventRecord(e, current_stream(index)));
    return e;
  }
  double elapsed_ms(void* begin, void* end) override {
    float ms = 0;
    KESTREL_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(begin), static_cast<cudaEvent_t>(end)));
    return ms;
  }
  void release_timestamp(void* timestamp) override { (void)cudaEventDestroy(static_cast<cudaEvent_t>(timestamp)); }
  MemoryConfig memory_config(int index) override {
    const Context* c = Context::find(index);
    return c ? c->memory_config() : default_memory_config();
  }
};

struct Registrar {
  Registrar() {
    static CudaDeviceBackend backend;
    detail::register_cuda_backend(&backend);
  }
} g_registrar;

}  // namespace
}  // namespace kestrel::cuda
