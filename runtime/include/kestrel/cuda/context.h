// The kernel-side CUDA API: which stream to launch on, the cuBLASLt handle and its workspace.
//
// For kernel authors (ops/cuda, models, train) and apps that write their own kernels: the optional
// `kestrel/cuda/` component (installed by a CUDA build only), since it includes cuda_runtime.h and
// cublasLt.h; kestrel/kestrel.h never includes it. Everything here initialises the device's context lazily on first
// use (streams, cuBLASLt handle, caching allocator, pinned pool, offloader), charging the memory the
// CUDA context and cuBLAS take as External in memory_trace(Device::cuda(i)).
//
// A launcher does:
//   cudaStream_t s = kestrel::cuda::current_stream();           // the compute stream (or a guard's)
//   my_kernel<<<grid, block, smem, s>>>(...); KESTREL_CUDA_CHECK_LAUNCH();
//   size_t ws_bytes; void* ws = kestrel::cuda::cublaslt_workspace(&ws_bytes);
//   kestrel::cuda::cublaslt_api().Matmul(kestrel::cuda::cublaslt_handle(), ..., ws, ws_bytes, s);
// (cuBLASLt is opened at run time: kestrel/cuda/cublaslt_api.h; libkestrel does not link it.)
// Temporary device buffers come from Tensor::empty (the caching allocator), never cudaMalloc.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace kestrel::cuda {

// The device kernels run on for this thread: set by DeviceGuard, else the CUDA runtime's current.
int current_device();
// Streaming multiprocessors of `device` (-1: current_device()), read from the device once: grid
// sizes come from it, never from a literal (kestrel/runtime/device_info.h describes the rest).
int sm_count(int device = -1);
// Bytes of `device`'s L2 cache (cudaDevAttrL2CacheSize), read once and cached like sm_count: the
// attention forward sizes its work sections from it.
int64_t l2_cache_bytes(int device = -1);
// The stream ops on `device` launch on: the innermost StreamGuard's, else the device's compute stream.
cudaStream_t current_stream(int device = -1);  // -1: current_device()
cudaStream_t compute_stream(int device = -1);
cudaStream_t h2d_stream(int device = -1);  // host -> device copies (prefetch, restore)
cudaStream_t d2h_stream(int device = -1);  // device -> host copies (offload, spill)
// The device's cuBLASLt handle and its workspace (allocated through the caching allocator, tag
// Workspace, 32 MiB). Use them on current_stream(); one op at a time per device and thread.
cublasLtHandle_t cublaslt_handle(int device = -1);
void* cublaslt_workspace(size_t* bytes, int device = -1);
// Whether f32 GEMMs on `device` may use TF32 tensor cores (MemoryConfig::matmul_tf32; an atomic
// read of the device's context, cheap enough for every call).
bool matmul_tf32(int device = -1);

// Makes `device` current for the scope (cudaSetDevice, restored on exit).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int saved_;
};

// Runs the scope's ops on `stream` (on the stream's device, current_device() by default).
// Allocations made inside belong to that stream (stream-aware reuse).
class StreamGuard {
 public:
  explicit StreamGuard(cudaStream_t stream, int device = -1);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  int device_;
  cudaStream_t saved_;
};

// An owned cudaEvent_t without timing (ordering between streams and host polling only).
class Event {
 public:
  Event();
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

// Makes `waiter` wait (on the device) for the work submitted so far to `producer`; no host sync.
void stream_wait(cudaStream_t waiter, cudaStream_t producer);

}  // namespace kestrel::cuda
