#!/usr/bin/env bash
# Attention at head dim 72 without padding (issue 24), on the device machine in one call: the flash
# attention GPU tests (the narrow kernels' references, the kernel choice, narrow == padded bitwise,
# the op table's attention cases), then the benchmarks: bench_flash_attention's D-72 rows (counted at
# D 72), the padded A/B rows and the so400m shape, bench/attention_vs_torch.py beside PyTorch's FA2
# and cuDNN (--quick: T 8k, plus the so400m table), and bench_vision_tower (the so400m tower's step).
#
# usage: tools/gpu-narrow-attention.sh BIN_DIR [tests|bench|all]
#   BIN_DIR: libkestrel.so, test_ops_cuda, bench_flash_attention, bench_vision_tower
#   (tools/gpu-build.sh gathers them into .carry/).
# Building BIN_DIR on the device instead, from the repository root:
#   cmake -S . -B /tmp/b -G Ninja -DCMAKE_BUILD_TYPE=Release -DKESTREL_CUDA=ON -DKESTREL_BUILD_TESTS=ON \
#     -DKESTREL_BUILD_BENCH=ON && cmake --build /tmp/b -j16 --target kestrel test_ops_cuda \
#     bench_flash_attention bench_vision_tower && mkdir -p /tmp/c && cp /tmp/b/libkestrel.so \
#     /tmp/b/tests/test_ops_cuda /tmp/b/bench/bench_flash_attention /tmp/b/bench/bench_vision_tower /tmp/c/ &&
#   bash tools/gpu-narrow-attention.sh /tmp/c
set -u
cd "$(dirname "$0")/.."
B=$(realpath "${1:-.carry}")
MODE=${2:-all}
RESULTS=${OUT:-/tmp/kestrel-narrow-attention}
mkdir -p "$RESULTS"
export LD_LIBRARY_PATH=$B:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader

if [ "$MODE" != bench ]; then
  echo "== tests"
  "$B/test_ops_cuda" --gtest_brief=1 \
    --gtest_filter='FlashAttentionCuda.*:*OpTable*attention*:*FlashAttentionPrefix*:*FlashAttentionWindow*' \
    >"$RESULTS/tests.log" 2>&1
  echo "test_ops_cuda exit $?"
  grep -E "narrow vs padded|D=(72|80|88|96|104|112|120) " "$RESULTS/tests.log" | head -n 40
  grep -E "FAILED|Failure|PASSED" "$RESULTS/tests.log" | tail -n 20
fi

if [ "$MODE" != tests ]; then
  echo "== bench_flash_attention (D 72, padded A/B, so400m)"
  "$B/bench_flash_attention" \
    --benchmark_filter='BM_flash_attention/T:(1024|8192|16384)/D:(72|128)/|BM_flash_attention_padded|BM_flash_attention_so400m' \
    --benchmark_min_warmup_time=0.3 \
    --benchmark_format=json --benchmark_out="$RESULTS/fa.json" --benchmark_out_format=json \
    --benchmark_counters_tabular=true 2>&1 | grep -E "^BM_|TFLOPs" | sed 's/ *manual_time//' | tail -n 40
  if python3 -c "import torch" 2>/dev/null; then
    echo "== attention_vs_torch --quick (T 8k; D 72 and the so400m table)"
    python3 bench/attention_vs_torch.py --quick --kestrel-json "$RESULTS/fa.json" 2>&1 | tee "$RESULTS/vs_torch.md"
  fi
  echo "== bench_vision_tower (so400m, 384 px, bf16)"
  "$B/bench_vision_tower" --benchmark_counters_tabular=true 2>&1 | tee "$RESULTS/tower.log" | grep -E "^BM_|images"
fi
