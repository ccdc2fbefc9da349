# Dependency wiring only: imported targets for what Kestrel links. Nothing is vendored.
# A missing dependency fails configuration with the Debian package that provides it.

function(kestrel_require found what debian_pkg)
  if(NOT ${found})
    message(FATAL_ERROR "Kestrel needs ${what}. Install it with: apt-get install ${debian_pkg}"
                        " (or run tools/test.sh, which installs it).")
  endif()
endfunction()

find_package(nlohmann_json 3 QUIET)
kestrel_require(nlohmann_json_FOUND "nlohmann_json (JSON for configs and safetensors headers)" nlohmann-json3-dev)

find_package(PNG QUIET)
kestrel_require(PNG_FOUND "libpng (PNG images for the image-text data path)" libpng-dev)

if(KESTREL_BUILD_TESTS)
  find_package(GTest QUIET)
  kestrel_require(GTest_FOUND "GoogleTest" libgtest-dev)
endif()

if(KESTREL_BUILD_BENCH)
  find_package(benchmark QUIET)
  kestrel_require(benchmark_FOUND "Google Benchmark" libbenchmark-dev)
endif()

if(KESTREL_CUDA)
  find_package(CUDAToolkit REQUIRED)  # CUDA::cudart, CUDA::cuda_driver, CUDA::cublasLt, CUDA::cublas
  # cuDNN and NCCL are not looked for: nothing uses them yet (patch embedding is unfold + GEMM, and
  # there is no multi-GPU training); DESIGN.md lists this among the departures.
  message(STATUS "Kestrel CUDA: toolkit ${CUDAToolkit_VERSION}, arch ${CMAKE_CUDA_ARCHITECTURES}")
endif()
