#!/usr/bin/env bash
# Builds everything (CUDA code too where nvcc exists) and runs every test through ctest.
# GPU tests skip cleanly on machines without a GPU. Usage: tools/test.sh [extra ctest args]
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup_deps.sh
kestrel_setup_deps
BUILD_DIR=${KESTREL_BUILD_DIR:-build}
kestrel_configure_and_build "$BUILD_DIR" -DKESTREL_BUILD_TESTS=ON -DKESTREL_BUILD_BENCH=ON
ctest --test-dir "$BUILD_DIR" --output-on-failure -j"$(nproc)" "$@"
