// cuBLASLt, opened at run time: the entry points Kestrel calls, resolved from libcublasLt.so.<major>
// (the major version of the cublasLt.h it was compiled against) the first time they are asked for.
//
// libkestrel has no load-time dependency on cuBLASLt: the library's static initialisation costs
// about 0.4 s and 25k page faults, which every process would otherwise pay at start-up whether or
// not it ever runs a GEMM (each test is its own process). It is opened when the first device
// context is created (which makes the device's cuBLASLt handle) or cublaslt_api() is first called.
// cublasLt.h supplies the types and signatures only. Kernel authors and apps call cuBLASLt through
// these pointers, so they need not link it either:
//   const auto& lt = kestrel::cuda::cublaslt_api();
//   KESTREL_CUBLAS_CHECK(lt.Matmul(kestrel::cuda::cublaslt_handle(), desc, ...));
#pragma once

#include <cublasLt.h>

namespace kestrel::cuda {

// The cuBLASLt functions Kestrel uses, named without their cublasLt prefix.
struct CublasLtApi {
  decltype(&cublasLtGetVersion) GetVersion = nullptr;
  decltype(&cublasLtCreate) Create = nullptr;
  decltype(&cublasLtDestroy) Destroy = nullptr;
  decltype(&cublasLtMatmul) Matmul = nullptr;
  decltype(&cublasLtMatmulDescCreate) MatmulDescCreate = nullptr;
  decltype(&cublasLtMatmulDescDestroy) MatmulDescDestroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) MatrixLayoutCreate = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) MatrixLayoutDestroy = nullptr;
  decltype(&cublasLtMatrixLayoutSetAttribute) MatrixLayoutSetAttribute = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) MatmulPreferenceCreate = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) MatmulPreferenceDestroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) MatmulPreferenceSetAttribute = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) MatmulAlgoGetHeuristic = nullptr;
};

// The process's cuBLASLt, loaded once (thread-safe; the library stays open for the process's life).
// Where it cannot be loaded this throws a kestrel::Error "[cublas] cannot load libcublasLt.so.N ..."
// saying what to install or put on LD_LIBRARY_PATH, and the next call tries again.
const CublasLtApi& cublaslt_api();

}  // namespace kestrel::cuda
