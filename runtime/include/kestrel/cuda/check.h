// Check macros for CUDA runtime, driver and cuBLAS(Lt) status codes.
// Each reports the failing expression, file:line and the library's error string.
// The *_NOTHROW variants log to stderr instead of throwing (for destructors).
// Only include from translation units compiled with the CUDA toolkit on the include path.
#pragma once

#include <cstdio>

#include <cuda_runtime.h>

#include "kestrel/runtime/error.h"

#define KESTREL_CUDA_CHECK(expr)                                                         \
  do {                                                                                   \
    cudaError_t kestrel_err_ = (expr);                                                   \
    if (kestrel_err_ != cudaSuccess)                                                     \
      throw ::kestrel::make_error("cuda", #expr, " failed: ", cudaGetErrorString(kestrel_err_), \
                                  " (", __FILE__, ":", __LINE__, ")");                   \
  } while (0)

#define KESTREL_CUDA_CHECK_NOTHROW(expr)                                                     \
  do {                                                                                       \
    cudaError_t kestrel_err_ = (expr);                                                       \
    if (kestrel_err_ != cudaSuccess)                                                         \
      std::fprintf(stderr, "[cuda] %s failed: %s (%s:%d)\n", #expr,                          \
                   cudaGetErrorString(kestrel_err_), __FILE__, __LINE__);                     \
  } while (0)

// After every kernel launch: surfaces launch-configuration errors at the launch site.
#define KESTREL_CUDA_CHECK_LAUNCH() KESTREL_CUDA_CHECK(cudaGetLastError())

#define KESTREL_CU_CHECK(expr)                                                              \
  do {                                                                                      \
    CUresult kestrel_res_ = (expr);                                                         \
    if (kestrel_res_ != CUDA_SUCCESS) {                                                     \
      const char* kestrel_msg_ = nullptr;                                                   \
      cuGetErrorString(kestrel_res_, &kestrel_msg_);                                        \
      throw ::kestrel::make_error("cuda-driver", #expr, " failed: ",                         \
                                  kestrel_msg_ ? kestrel_msg_ : "unknown", " (", __FILE__, ":", \
                                  __LINE__, ")");                                           \
    }                                                                                       \
  } while (0)

#define KESTREL_CUBLAS_CHECK(expr)                                                         \
  do {                                                                                     \
    int kestrel_st_ = static_cast<int>(expr);                                              \
    if (kestrel_st_ != 0)                                                                  \
      throw ::kestrel::make_error("cublas", #expr, " failed with status ", kestrel_st_, " (", \
                                  __FILE__, ":", __LINE__, ")");                           \
  } while (0)
