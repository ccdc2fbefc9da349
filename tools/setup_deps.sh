#!/usr/bin/env bash
# Installs the Debian packages Kestrel builds with, when missing (non-interactive; root or sudo).
# Sourced by tools/test.sh and tools/quickstart.sh.
kestrel_setup_deps() {
  local pkgs=(cmake ninja-build g++ pkg-config libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev libpng-dev)
  local missing=()
  for p in "${pkgs[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "[setup] installing missing Debian packages: ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
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
