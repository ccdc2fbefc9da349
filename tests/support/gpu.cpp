#include "support/gpu.h"

#if KESTREL_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace kestrel::testing {
bool gpu_available() {
#if KESTREL_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return n > 0;
#else
  return false;
#endif
}
}  // namespace kestrel::testing
