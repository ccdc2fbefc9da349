#!/usr/bin/env bash
# Makes sure the tools and libraries Kestrel builds with are there; installs only what is missing.
# Sourced by tools/test.sh (`kestrel_setup_deps`: everything) and tools/quickstart.sh
# (`kestrel_setup_deps quickstart`: no GoogleTest, Google Benchmark or pkg-config, as it builds no
# tests or benchmarks).
#
# Policy: test for what the build uses, never for Debian packages, so tools from pip, conda or a
# vendor build count: cmake >= 3.25 and ninja on PATH, a C++ compiler ($CXX, else c++ or g++) that
# compiles C++20, pkg-config, and the libraries found by the same find_package calls the build
# makes (nlohmann_json 3, libpng, GoogleTest, Google Benchmark; CMAKE_PREFIX_PATH is honoured).
# What is missing is installed with apt-get when that can work (apt-get present, root or
# passwordless sudo, a reachable registry); whatever is still missing is then listed with how to
# provide it, and kestrel_setup_deps returns 1 (nothing is installed when nothing is missing).
#
# Test hooks (tools/test_setup_deps.sh simulates machines with them):
#   KESTREL_SETUP_NO_APT=1        treat apt-get as unavailable (a machine without a registry);
#   KESTREL_SETUP_PROBE_ARGS="…"  extra arguments for the library probe's cmake, e.g.
#                                 -DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON to simulate a missing library.

# Fills _kestrel_missing (what, one per entry), _kestrel_missing_pkgs (Debian packages) and
# _kestrel_missing_howto (how to provide each) for the set `$1` (all | quickstart).
_kestrel_find_missing() {
  local set=$1
  _kestrel_missing=()
  _kestrel_missing_pkgs=()
  _kestrel_missing_howto=()
  _kestrel_need() {  # what, debian packages, how to provide it otherwise
    _kestrel_missing+=("$1")
    _kestrel_missing_pkgs+=($2)
    _kestrel_missing_howto+=("$3")
  }
  local cmake_ok=0 ninja_ok=0 cxx_ok=0
  if command -v cmake >/dev/null 2>&1; then
    local v
    v=$(cmake --version 2>/dev/null | head -n 1 | awk '{print $3}' || true)
    if [ -n "$v" ] && [ "$(printf '%s\n%s\n' 3.25 "$v" | sort -V | head -n 1)" = 3.25 ]; then
      cmake_ok=1
    else
      _kestrel_need "cmake >= 3.25 (found ${v:-an unreadable version} at $(command -v cmake))" cmake \
        "pip install 'cmake>=3.25' (or a newer cmake earlier on PATH)"
    fi
  else
    _kestrel_need "cmake >= 3.25 (no cmake on PATH)" cmake "apt-get install cmake, or pip install 'cmake>=3.25'"
  fi
  if command -v ninja >/dev/null 2>&1; then
    ninja_ok=1
  else
    _kestrel_need "ninja (no ninja on PATH)" ninja-build "apt-get install ninja-build, or pip install ninja"
  fi
  local cxx=${CXX:-}
  if [ -z "$cxx" ]; then
    cxx=$(command -v c++ 2>/dev/null || command -v g++ 2>/dev/null || true)
  fi
  if [ -n "$cxx" ] && printf '#include <span>\n#include <concepts>\n#include <bit>\nint main() { std::span<const int> s; return std::popcount(1u) - 1 + static_cast<int>(s.size()); }\n' |
      "$cxx" -std=c++20 -x c++ - -o /dev/null >/dev/null 2>&1; then
    cxx_ok=1
  else
    _kestrel_need "a C++20 compiler (${cxx:-no c++ or g++ on PATH}${cxx:+ does not compile C++20})" g++ \
      "apt-get install g++ (g++ 11 or newer), or set CXX to a C++20 compiler"
  fi
  if [ "$set" = all ] && ! command -v pkg-config >/dev/null 2>&1; then
    _kestrel_need "pkg-config (the installed-package check)" pkg-config "apt-get install pkg-config"
  fi
  # Libraries: only probed with a working cmake, ninja and compiler (the probe is a CMake project).
  if [ $cmake_ok = 1 ] && [ $ninja_ok = 1 ] && [ $cxx_ok = 1 ]; then
    local probe
    probe=$(mktemp -d "${TMPDIR:-/tmp}/kestrel_probe.XXXXXX")
    local pkgs="nlohmann_json PNG"
    [ "$set" = all ] && pkgs="$pkgs GTest benchmark"
    cat >"$probe/CMakeLists.txt" <<EOF
cmake_minimum_required(VERSION 3.25)
project(kestrel_probe CXX)
foreach(pkg IN ITEMS $pkgs)
  if(pkg STREQUAL "nlohmann_json")
    find_package(nlohmann_json 3 QUIET)
  else()
    find_package(\${pkg} QUIET)
  endif()
  if(NOT \${pkg}_FOUND)
    file(APPEND "\${CMAKE_BINARY_DIR}/missing.txt" "\${pkg}\n")
  endif()
endforeach()
EOF
    # shellcheck disable=SC2086
    if CXX="$cxx" cmake -S "$probe" -B "$probe/build" -G Ninja ${KESTREL_SETUP_PROBE_ARGS:-} >"$probe/log" 2>&1; then
      local lib
      for lib in $( [ -f "$probe/build/missing.txt" ] && cat "$probe/build/missing.txt"); do
        case $lib in
          nlohmann_json) _kestrel_need "nlohmann_json 3 (headers and CMake package)" nlohmann-json3-dev \
                           "apt-get install nlohmann-json3-dev, or conda install nlohmann_json and export CMAKE_PREFIX_PATH=\$CONDA_PREFIX" ;;
          PNG) _kestrel_need "libpng (headers and library)" libpng-dev \
                 "apt-get install libpng-dev, or conda install libpng and export CMAKE_PREFIX_PATH=\$CONDA_PREFIX" ;;
          GTest) _kestrel_need "GoogleTest (headers and libraries)" "libgtest-dev libgmock-dev" \
                   "apt-get install libgtest-dev libgmock-dev, or conda install gtest and export CMAKE_PREFIX_PATH=\$CONDA_PREFIX" ;;
          benchmark) _kestrel_need "Google Benchmark" libbenchmark-dev \
                       "apt-get install libbenchmark-dev, or conda install benchmark and export CMAKE_PREFIX_PATH=\$CONDA_PREFIX" ;;
        esac
      done
    else
      _kestrel_need "a cmake that can configure a C++ project (the probe failed: $(tail -n 3 "$probe/log" | tr '\n' ' '))" "" \
        "check that cmake, ninja and \$CXX work together (see the message above)"
    fi
    rm -rf "$probe"
  fi
  unset -f _kestrel_need
}

# True when apt-get can be used to install (present, root or passwordless sudo, not switched off).
_kestrel_can_apt() {
  [ -z "${KESTREL_SETUP_NO_APT:-}" ] || return 1
  command -v apt-get >/dev/null 2>&1 || return 1
  [ "$(id -u)" -eq 0 ] && return 0
  command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1
}

kestrel_setup_deps() {
  local set=all
  [ "${1:-}" = quickstart ] && set=quickstart
  _kestrel_find_missing "$set"
  # Two rounds: the libraries are probed only once cmake, ninja and the compiler work, so a bare
  # machine gets its tools first and its libraries second.
  local round updated=0 tried=""
  for round in 1 2; do
    [ ${#_kestrel_missing[@]} -gt 0 ] && [ ${#_kestrel_missing_pkgs[@]} -gt 0 ] && _kestrel_can_apt || break
    [ "${_kestrel_missing_pkgs[*]}" != "$tried" ] || break  # installed, yet still missing
    tried="${_kestrel_missing_pkgs[*]}"
    echo "[setup] missing: $(IFS=';'; echo "${_kestrel_missing[*]}")"
    echo "[setup] installing Debian packages: ${_kestrel_missing_pkgs[*]}"
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo -n"
    if { [ $updated = 1 ] || $sudo apt-get update -qq; } &&
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${_kestrel_missing_pkgs[@]}"; then
      updated=1
      hash -r
      _kestrel_find_missing "$set"
    else
      echo "[setup] apt-get could not install them (no package registry reachable?)" >&2
      break
    fi
  done
  if [ ${#_kestrel_missing[@]} -gt 0 ]; then
    echo "[setup] cannot build Kestrel: missing" >&2
    local i
    for i in "${!_kestrel_missing[@]}"; do
      echo "[setup]   - ${_kestrel_missing[$i]}: ${_kestrel_missing_howto[$i]}" >&2
    done
    _kestrel_can_apt || echo "[setup] (apt-get is not usable here${KESTREL_SETUP_NO_APT:+: KESTREL_SETUP_NO_APT is set}; install the above, then run again)" >&2
    return 1
  fi
  # CUDA: use nvcc when the toolkit is installed (the build then includes the GPU kernels and tests).
  if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH=/usr/local/cuda/bin:$PATH
  fi
  if [ -n "${KESTREL_CUDA:-}" ]; then
    KESTREL_CUDA_FLAG=$KESTREL_CUDA  # explicit choice (e.g. KESTREL_CUDA=OFF for a quick CPU-only build)
  elif command -v nvcc >/dev/null 2>&1; then
    KESTREL_CUDA_FLAG=ON
  else
    KESTREL_CUDA_FLAG=OFF
    echo "[setup] nvcc not found: building the CPU-only library (GPU kernels and tests are skipped)"
  fi
  export KESTREL_CUDA_FLAG
}

kestrel_configure_and_build() {
  local build_dir=$1
  shift
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKESTREL_CUDA="$KESTREL_CUDA_FLAG" "$@"
  cmake --build "$build_dir" -j"$(nproc)"
}
