#!/usr/bin/env bash
# Checks the layers' includes, builds everything (CUDA code too where nvcc exists), runs every test
# through ctest.
# GPU tests skip cleanly on machines without a GPU. Then checks the installed package with the consumer
# project in tests/consumer. Usage: tools/test.sh [extra ctest args]
# Environment: KESTREL_BUILD_DIR (default build), KESTREL_CUDA=ON|OFF (default: ON when nvcc exists).
set -euo pipefail
cd "$(dirname "$0")/.."
# The layering (runtime <- autograd <- ops <- models <- train <- tools) from the includes: a second,
# before anything is built.
bash tools/check_layers.sh
source tools/setup_deps.sh
kestrel_setup_deps
BUILD_DIR=${KESTREL_BUILD_DIR:-build}
kestrel_configure_and_build "$BUILD_DIR" -DKESTREL_BUILD_TESTS=ON -DKESTREL_BUILD_BENCH=ON
ctest --test-dir "$BUILD_DIR" --output-on-failure -j"$(nproc)" "$@"
# The installable package: install into a temporary prefix, build and run tests/consumer against it
# (find_package and pkg-config). Reuses the build above; only the tiny consumer is compiled.
bash tests/consumer/check_package.sh "$BUILD_DIR"
