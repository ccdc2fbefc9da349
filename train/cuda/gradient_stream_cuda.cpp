// The CUDA side of GradientStream (train/src/gradient_stream.h): one pinned buffer, copies on the D2H
// stream ordered after the compute stream by an event, and record_stream so the gradient's block
// returns to the allocator only after its copy has read it.
#include <cuda_runtime.h>

#include <algorithm>

#include "kestrel/runtime/allocator.h"
#include "kestrel/cuda/check.h"
#include "kestrel/cuda/context.h"
#include "kestrel/runtime/error.h"
#include "kestrel/runtime/memory_budget.h"
#include "src/gradient_stream.h"

namespace kestrel::train {
namespace {

class CudaCopier final : public GradientStream::Copier {
 public:
  explicit CudaCopier(int device) : device_(device) {}

  std::shared_ptr<void> allocate(int64_t bytes) override {
    cuda::DeviceGuard g(device_);
    void* p = nullptr;
    const cudaError_t e = cudaHostAlloc(&p, static_cast<size_t>(std::max<int64_t>(bytes, 1)), cudaHostAllocDefault);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      throw make_error("gradient-stream", "cannot pin ", format_bytes(bytes),
                       " of host memory for the gradients (optimizer.gradients=\"host\"): ", cudaGetErrorString(e),
                       ". Free host memory or keep the gradients on the device (optimizer.gradients=\"device\").");
    }
    return std::shared_ptr<void>(p, [](void* q) { cudaFreeHost(q); });
  }

  void copy(const Tensor& grad, const Tensor& host) override {
    cuda::DeviceGuard g(device_);
    cudaStream_t d2h = cuda::d2h_stream(device_);
    cuda::stream_wait(d2h, cuda::current_stream(device_));  // the gradient's producer has run
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(host.data_ptr(), grad.data_ptr(), grad.nbytes(), cudaMemcpyDeviceToHost, d2h));
    allocator_for(grad.device()).record_stream(grad.storage()->allocation(), d2h);
    pending_ = true;
  }

  void wait() override {
    if (!pending_) return;
    cuda::DeviceGuard g(device_);
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(cuda::d2h_stream(device_)));
    pending_ = false;
  }

 private:
  int device_;
  bool pending_ = false;
};

}  // namespace

std::unique_ptr<GradientStream::Copier> make_cuda_gradient_copier(int device) {
  return std::make_unique<CudaCopier>(device);
}

}  // namespace kestrel::train
