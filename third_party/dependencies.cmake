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
  find_package(CUDAToolkit REQUIRED)  # CUDA::cudart, CUDA::cuda_driver (cuBLASLt is dlopened; CUDA::cublas: bench_ops)
  # NCCL is optional: the communicator's NCCL backend (runtime/cuda/comm_nccl.cpp) is compiled where nccl.h
  # is found next to the toolkit (or under NCCL_ROOT / KESTREL_NCCL_ROOT) and skipped otherwise
  # (make_nccl_communicator then refuses, naming the missing build). libnccl itself is opened at
  # run time (dlopen), so libkestrel loads where it is absent. KESTREL_NCCL=OFF skips the backend.
  option(KESTREL_NCCL "Build the NCCL communicator backend when nccl.h is found" ON)
  set(KESTREL_HAVE_NCCL OFF)
  if(KESTREL_NCCL)
    find_path(KESTREL_NCCL_INCLUDE_DIR nccl.h
              HINTS ${KESTREL_NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include)
    if(KESTREL_NCCL_INCLUDE_DIR)
      set(KESTREL_HAVE_NCCL ON)
      add_library(kestrel_nccl INTERFACE IMPORTED)
      target_include_directories(kestrel_nccl INTERFACE ${KESTREL_NCCL_INCLUDE_DIR})
      target_link_libraries(kestrel_nccl INTERFACE ${CMAKE_DL_LIBS})
    endif()
  endif()
  # cuDNN is optional: the second attention backend (ops/cuda/cudnn_attention/, the fused
  # flash-attention graph through cuDNN's C backend API; cudnn-frontend is not used) is compiled
  # where cudnn_graph.h and libcudnn (9.x) are found next to the toolkit or under CUDNN_ROOT /
  # KESTREL_CUDNN_ROOT, and skipped otherwise: then AttentionOptions::backend = Cudnn (config key
  # attention.backend "cudnn") is refused naming the missing build, and "auto" runs Kestrel's kernels.
  # libkestrel links libcudnn.so (a small loader that opens its engine libraries on first use).
  # KESTREL_CUDNN=OFF skips the backend.
  option(KESTREL_CUDNN "Build the cuDNN attention backend when cuDNN 9 is found" ON)
  set(KESTREL_HAVE_CUDNN OFF)
  if(KESTREL_CUDNN)
    find_path(KESTREL_CUDNN_INCLUDE_DIR cudnn_graph.h
              HINTS ${KESTREL_CUDNN_ROOT} $ENV{CUDNN_ROOT} ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include)
    find_library(KESTREL_CUDNN_LIBRARY cudnn
                 HINTS ${KESTREL_CUDNN_ROOT} $ENV{CUDNN_ROOT} ${CUDAToolkit_LIBRARY_DIR}
                 PATH_SUFFIXES lib64 lib lib/x86_64-linux-gnu)
    if(KESTREL_CUDNN_INCLUDE_DIR AND KESTREL_CUDNN_LIBRARY)
      file(STRINGS ${KESTREL_CUDNN_INCLUDE_DIR}/cudnn_version.h _cudnn_major REGEX "^#define CUDNN_MAJOR [0-9]+")
      string(REGEX REPLACE "^#define CUDNN_MAJOR ([0-9]+)" "\\1" _cudnn_major "${_cudnn_major}")
      if(_cudnn_major GREATER_EQUAL 9)
        set(KESTREL_HAVE_CUDNN ON)
        add_library(kestrel_cudnn INTERFACE IMPORTED)
        target_include_directories(kestrel_cudnn INTERFACE ${KESTREL_CUDNN_INCLUDE_DIR})
        target_link_libraries(kestrel_cudnn INTERFACE ${KESTREL_CUDNN_LIBRARY})
      endif()
    endif()
  endif()
  message(STATUS "Kestrel CUDA: toolkit ${CUDAToolkit_VERSION}, arch ${CMAKE_CUDA_ARCHITECTURES}, "
                 "NCCL backend ${KESTREL_HAVE_NCCL} (${KESTREL_NCCL_INCLUDE_DIR}), "
                 "cuDNN attention ${KESTREL_HAVE_CUDNN} (${KESTREL_CUDNN_LIBRARY})")
endif()
