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
  # cuDNN and NCCL ship as plain libraries (CUDA install or Debian/NVIDIA packages): imported targets.
  find_path(CUDNN_INCLUDE_DIR cudnn.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/include /usr/include/x86_64-linux-gnu)
  find_library(CUDNN_LIBRARY cudnn HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/lib/x86_64-linux-gnu)
  if(CUDNN_INCLUDE_DIR AND CUDNN_LIBRARY)
    add_library(kestrel_cudnn UNKNOWN IMPORTED)
    set_target_properties(kestrel_cudnn PROPERTIES IMPORTED_LOCATION ${CUDNN_LIBRARY}
                          INTERFACE_INCLUDE_DIRECTORIES ${CUDNN_INCLUDE_DIR})
    set(KESTREL_HAVE_CUDNN ON PARENT_SCOPE)
    set(KESTREL_HAVE_CUDNN ON)
  endif()
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/include)
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/lib/x86_64-linux-gnu)
  if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    add_library(kestrel_nccl UNKNOWN IMPORTED)
    set_target_properties(kestrel_nccl PROPERTIES IMPORTED_LOCATION ${NCCL_LIBRARY}
                          INTERFACE_INCLUDE_DIRECTORIES ${NCCL_INCLUDE_DIR})
    set(KESTREL_HAVE_NCCL ON)
  endif()
  message(STATUS "Kestrel CUDA: toolkit ${CUDAToolkit_VERSION}, arch ${CMAKE_CUDA_ARCHITECTURES}, "
                 "cuDNN ${KESTREL_HAVE_CUDNN}, NCCL ${KESTREL_HAVE_NCCL}")
endif()
