# Packaging: `cmake --install <build> --prefix <dir>` produces a relocatable package for embedders:
#   include/kestrel/...                      the public headers (KESTREL_INTERNAL_HEADERS and private
#                                            ones stay behind), the umbrella kestrel/kestrel.h
#                                            (top-level include/) and, built with CUDA, kestrel/cuda/
#   lib/libkestrel.so                        RPATH $ORIGIN (+ the CUDA library dir when built with CUDA)
#   lib/cmake/kestrel/kestrelConfig.cmake    find_package(kestrel CONFIG) -> kestrel::kestrel
#   lib/cmake/kestrel/kestrelConfigVersion.cmake
#   lib/pkgconfig/kestrel.pc                 pkg-config kestrel (prefix derived from ${pcfiledir})
#   bin/kestrel-*                            the command-line tools, RPATH $ORIGIN/../lib
# Included by the top-level CMakeLists.txt after the library and binaries are defined.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(KESTREL_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/kestrel)

# The library finds its own dependencies relative to itself once installed; libraries outside the
# system paths it linked against (the CUDA toolkit's) stay on its RPATH.
set_target_properties(kestrel PROPERTIES INSTALL_RPATH "$ORIGIN" INSTALL_RPATH_USE_LINK_PATH ON)

install(TARGETS kestrel EXPORT kestrelTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# The installed headers are what an embedding app needs (kestrel/kestrel.h and what it includes, the
# safetensors and token-file formats), nothing more. Headers that other layers of this tree include
# but an app does not stay behind: the tools' and the trainer's internals (planner, profiler and its
# PyTorch-snapshot writer, data loaders, tokenizers, image decoding), kernel plumbing (dtype
# dispatch, workspace sizes) and the binaries' number parsing. tests/consumer/check_package.sh checks
# that every installed header compiles on its own from the install tree.
set(KESTREL_INTERNAL_HEADERS
    runtime/dtype_dispatch.h runtime/parse_number.h
    ops/workspace_sizes.h
    models/json_text.h
    train/bpe_tokenizer.h train/host_batch.h train/image_io.h train/memory_plan.h train/memory_profile.h
    train/memory_viz_export.h train/pickle_writer.h train/shapes_dataset.h train/token_data.h
    train/tokenize_text.h train/tokenizer.h train/vlm_data.h train/chat_data.h
    train/image_tiling.h)
list(TRANSFORM KESTREL_INTERNAL_HEADERS REPLACE "^([a-z_]+)/([a-z0-9_]+)\\.h$" "/kestrel/\\1/\\2.h$")
list(JOIN KESTREL_INTERNAL_HEADERS "|" _kestrel_internal_regex)
foreach(dir IN LISTS KESTREL_LAYERS ITEMS .)  # "." : the umbrella kestrel/kestrel.h in include/
  install(DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/${dir}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
          FILES_MATCHING PATTERN "*.h"
          REGEX "(${_kestrel_internal_regex})" EXCLUDE
          REGEX "/kestrel/cuda(/|$)" EXCLUDE)
endforeach()
# The optional CUDA component: headers with CUDA types (cuda_runtime.h, cublasLt.h) or a CUDA-only
# API, for apps that launch their own kernels on Kestrel's streams. A CPU build installs none.
if(KESTREL_CUDA)
  install(DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/runtime/include/kestrel/cuda DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/kestrel
          COMPONENT cuda FILES_MATCHING PATTERN "*.h")
endif()

# The top-level executables (kestrel-train, kestrel-demo, kestrel-grad, ...); tests and benches live in
# subdirectories and are not installed.
file(RELATIVE_PATH _kestrel_bin_to_lib ${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_BINDIR}
     ${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_LIBDIR})
get_property(_kestrel_targets DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR} PROPERTY BUILDSYSTEM_TARGETS)
foreach(t IN LISTS _kestrel_targets)
  get_target_property(_type ${t} TYPE)
  if(_type STREQUAL "EXECUTABLE")
    set_target_properties(${t} PROPERTIES INSTALL_RPATH "$ORIGIN/${_kestrel_bin_to_lib}" INSTALL_RPATH_USE_LINK_PATH ON)
    install(TARGETS ${t} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  endif()
endforeach()

install(EXPORT kestrelTargets NAMESPACE kestrel:: FILE kestrelTargets.cmake DESTINATION ${KESTREL_CMAKE_DIR})

set(KESTREL_PACKAGE_WITH_CUDA ${KESTREL_CUDA})
configure_package_config_file(${CMAKE_CURRENT_SOURCE_DIR}/third_party/kestrelConfig.cmake.in
                              ${CMAKE_CURRENT_BINARY_DIR}/package/kestrelConfig.cmake
                              INSTALL_DESTINATION ${KESTREL_CMAKE_DIR})
# 0.x: a new minor version may break the API, so only the same major.minor is compatible.
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/package/kestrelConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/package/kestrelConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/package/kestrelConfigVersion.cmake
        DESTINATION ${KESTREL_CMAKE_DIR})

# pkg-config: the prefix is computed from the .pc file's own location, so the tree can be moved.
file(RELATIVE_PATH KESTREL_PC_TO_PREFIX ${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_LIBDIR}/pkgconfig ${CMAKE_INSTALL_PREFIX})
string(REGEX REPLACE "/$" "" KESTREL_PC_TO_PREFIX "${KESTREL_PC_TO_PREFIX}")
if(KESTREL_CUDA)
  set(KESTREL_PC_WITH_CUDA 1)
else()
  set(KESTREL_PC_WITH_CUDA 0)
endif()
configure_file(${CMAKE_CURRENT_SOURCE_DIR}/third_party/kestrel.pc.in ${CMAKE_CURRENT_BINARY_DIR}/package/kestrel.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/package/kestrel.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
