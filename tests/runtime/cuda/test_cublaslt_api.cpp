// cuBLASLt opened at run time (kestrel/cuda/cublaslt_api.h): the default library loads and matches
// the headers, and a library that is absent or is not cuBLASLt gives an error naming it and what to
// do. None of this needs a GPU (dlopen and cublasLtGetVersion only), so it runs everywhere the CUDA
// build does; the GEMM paths themselves are covered by the op tests on the device.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <string>

#include "cuda/cublaslt_loader.h"
#include "kestrel/cuda/cublaslt_api.h"
#include "support/errors.h"

namespace kestrel {
namespace {

using testing::error_of;
using testing::expect_has;

TEST(CublasLtApi, LibraryNameCarriesTheHeadersMajorVersion) {
  EXPECT_EQ(cuda::cublaslt_library_name(), "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR));
}

TEST(CublasLtApi, DefaultLibraryLoadsEveryEntryPointAndMatchesTheHeaders) {
  const cuda::CublasLtApi& api = cuda::cublaslt_api();
  EXPECT_EQ(&api, &cuda::cublaslt_api());  // loaded once
  for (const void* fn : {reinterpret_cast<const void*>(api.GetVersion), reinterpret_cast<const void*>(api.Create),
                         reinterpret_cast<const void*>(api.Destroy), reinterpret_cast<const void*>(api.Matmul),
                         reinterpret_cast<const void*>(api.MatmulDescCreate),
                         reinterpret_cast<const void*>(api.MatmulDescDestroy),
                         reinterpret_cast<const void*>(api.MatmulDescSetAttribute),
                         reinterpret_cast<const void*>(api.MatrixLayoutCreate),
                         reinterpret_cast<const void*>(api.MatrixLayoutDestroy),
                         reinterpret_cast<const void*>(api.MatrixLayoutSetAttribute),
                         reinterpret_cast<const void*>(api.MatmulPreferenceCreate),
                         reinterpret_cast<const void*>(api.MatmulPreferenceDestroy),
                         reinterpret_cast<const void*>(api.MatmulPreferenceSetAttribute),
                         reinterpret_cast<const void*>(api.MatmulAlgoGetHeuristic)})
    EXPECT_NE(fn, nullptr);
  EXPECT_EQ(api.GetVersion() / 10000, static_cast<size_t>(CUBLAS_VER_MAJOR));
  // Host-only objects: creating and destroying a layout needs no device.
  cublasLtMatrixLayout_t layout = nullptr;
  ASSERT_EQ(api.MatrixLayoutCreate(&layout, CUDA_R_32F, 4, 3, 4), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(api.MatrixLayoutDestroy(layout), CUBLAS_STATUS_SUCCESS);
}

TEST(CublasLtApi, AnAbsentLibraryIsAnErrorNamingItAndWhatToDo) {
  const std::string name = "libcublasLt-kestrel-test-absent.so.0";
  const std::string msg = error_of([&] { cuda::load_cublaslt(name); });
  expect_has(msg, {"[cublas]", "cannot load " + name, "beside libcudart", "LD_LIBRARY_PATH"});
  const std::string path = "/nonexistent-kestrel-test/libcublasLt.so.13";
  expect_has(error_of([&] { cuda::load_cublaslt(path); }), {"[cublas]", "cannot load " + path, "LD_LIBRARY_PATH"});
}

TEST(CublasLtApi, ALibraryThatIsNotCublasLtIsRefusedByName) {
  // libcudart is loaded (libkestrel links it) and found by name, but has no cuBLASLt entry point.
  const std::string name = "libcudart.so." + std::to_string(CUDART_VERSION / 1000);
  expect_has(error_of([&] { cuda::load_cublaslt(name); }), {"[cublas]", name, "has no cublasLtGetVersion"});
}

}  // namespace
}  // namespace kestrel
