#!/usr/bin/env bash
# Issue 24's VLM evidence on the device machine (torch + transformers there), in one call:
#   parity: writes the LLaVA fixture (tests/train/fixtures/make_llava_fixture.py) into $OUT/llava_qwen2 (copy it
#           back to tests/train/fixtures/llava_qwen2/ and commit it), runs the GPU test on it, and
#           bench/vlm_parity_gpu.py at its GPU sizes and at the fixture's (Kestrel CPU f32 and CUDA bf16 against
#           transformers f32 and bf16);
#   stages: bench/vlm_stages.py on CUDA (towers pretrained on another shapes variant, stage 1, stage 2, scratch);
#   all:    both (about 5 minutes).
# Results under $OUT: logs.txt (every step's output), llava_qwen2/{config.json, model.safetensors,
# expected.safetensors}, vlm_stages.json, vlm_stages.md. A summary of exit codes is printed last.
#
# usage: tools/gpu-vlm-parity.sh [BIN_DIR] [parity|stages|all]    (BIN_DIR from tools/gpu-build.sh, default .carry)
set -u
cd "$(dirname "$0")/.."
B=$(realpath "${1:-.carry}")
MODE=${2:-all}
R=${OUT:-/tmp/kestrel-vlm-parity}
W=/tmp/kestrel-vlm-work
mkdir -p "$R" "$W"
export LD_LIBRARY_PATH=$B:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
: >"$W/logs.txt"
summary=()
step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 limit=$2
  shift 2
  echo "=================== $name: $*" | tee -a "$W/logs.txt"
  timeout "$limit" "$@" 2>&1 | tee -a "$W/logs.txt" | tail -n 25
  local rc=${PIPESTATUS[0]}
  echo "=================== $name: exit $rc" | tee -a "$W/logs.txt"
  summary+=("$name: exit $rc")
}

if [ "$MODE" = parity ] || [ "$MODE" = all ]; then
  step fixture 180 python3 tests/train/fixtures/make_llava_fixture.py --out "$R"
  if [ -f "$R/llava_qwen2/expected.safetensors" ]; then  # the GPU test reads tests/train/fixtures/llava_qwen2
    mkdir -p tests/train/fixtures/llava_qwen2
    cp "$R"/llava_qwen2/* tests/train/fixtures/llava_qwen2/
  fi
  [ -x "$B/test_train_cuda" ] && step test_vlm_cuda 180 "$B/test_train_cuda" --gtest_filter='VlmHfParityCuda.*'
  step vlm_parity_gpu_sizes 300 python3 bench/vlm_parity_gpu.py --kestrel-grad "$B/kestrel-grad" --out "$W/parity"
  step vlm_parity_fixture_sizes 180 python3 bench/vlm_parity_gpu.py --kestrel-grad "$B/kestrel-grad" --sizes fixture \
    --out "$W/parity_small"
fi
if [ "$MODE" = stages ] || [ "$MODE" = all ]; then
  step vlm_stages 540 python3 bench/vlm_stages.py --bin "$B/kestrel-train" --device cuda --out "$W/stages"
  cp "$W/stages/vlm_stages.json" "$W/stages/vlm_stages.md" "$R/" 2>/dev/null
fi
cp "$W/logs.txt" "$R/"
echo
echo "== summary"
printf '%s\n' "${summary[@]}"
grep -h -E "^(PASS|FAIL)|^kestrel (cpu|cuda)|\[llava fixture|^stage 1:|^\| VLM stage|fewer steps" "$W/logs.txt"
true
