# Packaging: `cmake --install <build> --prefix <dir>` produces a relocatable package for embedders:
#   include/kestrel/...                      every layer's public headers (private ones stay behind)
#                                            and the umbrella kestrel/kestrel.h (top-level include/)
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
foreach(dir IN LISTS KESTREL_LAYERS ITEMS .)  # "." : the umbrella kestrel/kestrel.h in include/
  install(DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/${dir}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
          FILES_MATCHING PATTERN "*.h")
endforeach()

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
