#!/usr/bin/env bash
# Checks the layers' includes, builds everything (CUDA code too where nvcc exists), runs every test
# through ctest.
# GPU tests skip cleanly on machines without a GPU. Then checks the installed package with the consumer
# project in tests/consumer, and runs the sanitizer step (tools/sanitize.sh: ThreadSanitizer over the
# CPU pool's stress tests, AddressSanitizer + UBSan over the runtime, autograd, models and train
# suites; about 10 minutes on two cores). Usage: tools/test.sh [extra ctest args]
# Environment: KESTREL_BUILD_DIR (default build), KESTREL_CUDA=ON|OFF (default: ON when nvcc exists),
# KESTREL_SANITIZE=0 skips the sanitizer step (local runs; CI runs it).
set -euo pipefail
cd "$(dirname "$0")/.."
# The layering (runtime <- autograd <- ops <- models <- train <- tools) from the includes: a second,
# before anything is built.
bash tools/check_layers.sh
source tools/setup_deps.sh
kestrel_setup_deps
BUILD_DIR=${KESTREL_BUILD_DIR:-build}
t_start=$(date +%s)
phase() { echo "[test.sh] $1 done at $(( $(date +%s) - t_start )) s"; }  # CI's time budget, per phase
phase "set-up"
# Eight flash attention instantiation files per nvcc unit (CMakeLists.txt, KESTREL_CUDA_INST_PER_TU)
# and the CPU test suites in unity batches (KESTREL_UNITY_TESTS): the same code in a fraction of the
# compile time on CI's two cores.
kestrel_configure_and_build "$BUILD_DIR" -DKESTREL_BUILD_TESTS=ON -DKESTREL_BUILD_BENCH=ON -DKESTREL_CUDA_INST_PER_TU=8 \
  -DKESTREL_UNITY_TESTS=ON
phase "build"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j"$(nproc)" "$@"
phase "ctest"
# The installable package: install into a temporary prefix, build and run tests/consumer against it
# (find_package and pkg-config). Reuses the build above; only the tiny consumer is compiled.
bash tests/consumer/check_package.sh "$BUILD_DIR"
phase "package check"
# Sanitizers (CPU only, their own build folders): a data race, a memory error or undefined behaviour
# fails CI.
bash tools/sanitize.sh
