#!/usr/bin/env bash
# Builds the CUDA configuration here (no GPU needed) and gathers what tools/gpu-check.sh needs into
# one carriable folder (default .carry/, ignored by git): libkestrel.so, the GPU test and bench
# binaries, kestrel-train, kestrel-grad, and the shared libraries the device image may lack.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${KESTREL_CUDA_BUILD_DIR:-build-cuda}
DEST=${1:-.carry}
export PATH=/usr/local/cuda/bin:$PATH
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKESTREL_CUDA=ON -DKESTREL_BUILD_TESTS=ON -DKESTREL_BUILD_BENCH=ON >/dev/null
targets=(kestrel kestrel-train kestrel-grad kestrel-mem test_runtime_cuda test_ops_cuda bench_flash_attention
         bench_fused_linear_cross_entropy bench_ops bench_cuda_runtime bench_vision_tower bench_fp8_linear)
for layer in models train; do  # GPU test binaries that exist once their folder has sources
  compgen -G "tests/$layer/cuda/*.c*" >/dev/null && targets+=("test_${layer}_cuda")
done
cmake --build "$BUILD" -j"${JOBS:-2}" --target "${targets[@]}"
rm -rf "$DEST"
mkdir -p "$DEST"
cp "$BUILD/libkestrel.so" "$BUILD/kestrel-train" "$BUILD/kestrel-grad" "$BUILD/kestrel-mem" "$DEST/"
for t in test_runtime_cuda test_ops_cuda test_models_cuda test_train_cuda; do [ -f "$BUILD/tests/$t" ] && cp "$BUILD/tests/$t" "$DEST/"; done
for b in bench_flash_attention bench_fused_linear_cross_entropy bench_ops bench_cuda_runtime bench_vision_tower bench_fp8_linear; do
  [ -f "$BUILD/bench/$b" ] && cp "$BUILD/bench/$b" "$DEST/"
done
for lib in libpng16.so.16 libbenchmark.so.1debian; do
  p=$(ldconfig -p | awk -v l="$lib" '$1 == l {print $NF; exit}')
  [ -n "$p" ] && cp -L "$p" "$DEST/"
done
du -sh "$DEST"
