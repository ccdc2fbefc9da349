// Private: the table of device operations the runtime needs from a device backend.
// The CUDA backend (runtime/cuda/) registers itself at load time; a CPU-only build has none, and
// any request for a CUDA tensor then fails with a clear error.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kestrel/runtime/device_info.h"
#include "kestrel/runtime/memory_config.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::detail {

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  virtual int device_count() = 0;
  // Copies bytes between host and device or device and device; ordered on the compute stream
  // and complete (for host destinations) when it returns.
  virtual void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) = 0;
  // dst and src on the same CUDA device, same shape, any strides and dtypes (converting).
  virtual void strided_copy(const Tensor& dst, const Tensor& src) = 0;
  virtual void fill(const Tensor& dst, double value) = 0;
  // dst += src elementwise (same shape, same device, floating dtypes, any strides).
  virtual void add_into(const Tensor& dst, const Tensor& src) = 0;
  virtual void synchronize(Device device) = 0;
  // Philox fills of a contiguous floating tensor on the device, identical to random.cpp's host
  // stream for the same (seed, offset): uniform in [a, b), or normal with mean a and std b.
  virtual void fill_random(const Tensor& dst, bool normal, uint64_t seed, uint64_t offset, double a, double b) = 0;
  // Name, SM count, compute capability and memory of device `index` (device_info.cpp adds the peak).
  virtual DeviceInfo device_info(int index) = 0;
  // Pushes a validated config into device `index` (initialising it with it when it is not yet);
  // reads what it runs with (the defaults before it is initialised).
  virtual void configure_memory(int index, const MemoryConfig& config) = 0;
  virtual MemoryConfig memory_config(int index) = 0;
  // Op timing (kestrel/runtime/op_profile.h): a timestamp recorded on device `index`'s current
  // stream (an opaque event), the milliseconds between two once the device has passed both, and
  // the timestamp's release.
  virtual void* record_timestamp(int index) = 0;
  virtual double elapsed_ms(void* begin, void* end) = 0;
  virtual void release_timestamp(void* timestamp) = 0;
};

void register_cuda_backend(DeviceBackend* backend);
// The registered CUDA backend; throws "[device] ... built without CUDA" / "no CUDA device" when absent.
DeviceBackend& cuda_backend();
bool has_cuda_backend();

// CPU strided, converting copy (same shape, any strides/dtypes). Parallel over the outer dims.
void cpu_strided_copy(const Tensor& dst, const Tensor& src);
void cpu_fill(const Tensor& dst, double value);
void cpu_add_into(const Tensor& dst, const Tensor& src);

}  // namespace kestrel::detail
