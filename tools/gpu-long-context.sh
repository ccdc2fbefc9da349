#!/usr/bin/env bash
# Issue 20's runs on the device machine in one call: the long-context GPU tests, then kestrel-train
# runs at long lengths inside --memory-budget 40GiB observed through NVML (bench/train_memory_run.py),
# each next to the planner's prediction; a summary table last.
#
# usage: tools/gpu-long-context.sh BIN_DIR [tests|1b5|9b|all]
#   BIN_DIR: libkestrel.so, kestrel-train, kestrel-mem and the test binaries (build line below).
#   tests: tiled MLP, gradient stream, offload and long-context decoder GPU tests
#   1b5  : the 1.5B decoder (configs/llama_1b5_8k.json) at LC_LENS (default 131072) tokens, one document
#          per sequence (data.doc_start_token=-1: attention over the whole length), optimizer state on the
#          host, recompute=recompute and recompute=offload at the first length (the GPU's wait on the
#          region copies is the difference), offload alone at the others
#   9b   : the 9.03B / 250k decoder (configs/llama_9b_250k_8k.json) at LC_LENS9 (default 65536) tokens,
#          state (bf16 moments) and gradients on the host (optimizer.gradients=host), recompute=offload
# Environment: LC_STEPS (default 3; the first is left out of tok/s), LC_SET="k=v ..." extra --set entries.
# Building BIN on the device (about a minute on its 16 cores), from the repository root:
#   cmake -S . -B /tmp/b -G Ninja -DCMAKE_BUILD_TYPE=Release -DKESTREL_CUDA=ON -DKESTREL_BUILD_TESTS=ON &&
#   cmake --build /tmp/b -j16 --target kestrel kestrel-train kestrel-mem test_ops_cuda test_train_cuda \
#     test_models_cuda && mkdir -p /tmp/c && cp /tmp/b/libkestrel.so /tmp/b/kestrel-train /tmp/b/kestrel-mem \
#     /tmp/b/tests/test_* /tmp/c/ && bash tools/gpu-long-context.sh /tmp/c all
set -u
cd "$(dirname "$0")/.."
B=$(realpath "${1:-.carry}")
MODE=${2:-all}
LOGS=/tmp/kestrel-lc-logs
mkdir -p "$LOGS"
export LD_LIBRARY_PATH=$B:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
echo "host: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2 " GiB RAM, " $7 " GiB available"}')"
STEPS=${LC_STEPS:-3}
extra=()
for kv in ${LC_SET:-}; do extra+=(--set "$kv"); done
rows=()
run() {  # run LABEL TIMEOUT CONFIG [--set k=v ...]: the plan, then the run
  local label=$1 limit=$2 cfg=$3
  shift 3
  local plan
  plan=$("$B/kestrel-mem" plan --config "$cfg" --memory-budget 40GiB "$@" "${extra[@]}" 2>&1 |
         grep -E "peak in use|\+ external|MLP over|FITS|host \(" | tr '\n' ';')
  echo "== $label plan: $plan"
  timeout "$limit" python3 bench/train_memory_run.py --bin "$B" --config "$cfg" --label "$label" --warmup 1 \
    --timeout "$limit" --json "$LOGS/$label.json" "$@" "${extra[@]}" >"$LOGS/$label.log" 2>&1
  echo "== $label: exit $?"
  grep -E "^step|mlp_tile|gradients=host|OutOfBudget|error|Error" "$LOGS/$label.log" | tail -n 5
  rows+=("$(grep '^| ' "$LOGS/$label.log" | tail -n 1) plan: $(echo "$plan" | grep -oE '\+ external +[0-9.]+ GiB' | head -1)")
}

if [ "$MODE" = tests ] || [ "$MODE" = all ]; then
  "$B/test_ops_cuda" --gtest_brief=1 --gtest_filter='SwigluMlpTiledCuda*' 2>&1 | tail -n 3
  "$B/test_train_cuda" --gtest_brief=1 --gtest_filter='GradientStreamCuda*:AdamWOffload*' 2>&1 | tail -n 3
  "$B/test_models_cuda" --gtest_brief=1 --gtest_filter='LongContextCuda*:ModelsCuda*' 2>&1 | tail -n 3
fi
common=(--set memory_budget=40GiB --set data.doc_start_token=-1 --set train.steps="$STEPS" --set log_every=1
        --set optimizer.offload=host --set checkpoint_every=0)
if [ "$MODE" = 1b5 ] || [ "$MODE" = all ]; then
  first=1
  for L in ${LC_LENS:-131072}; do
    if [ $first = 1 ]; then
      run "1b5_${L}_recompute" 560 configs/llama_1b5_8k.json "${common[@]}" --set data.seq_len="$L" \
        --set recompute=recompute --set out_dir=/tmp/lc/1b5_${L}_r
      first=0
    fi
    run "1b5_${L}_offload" 560 configs/llama_1b5_8k.json "${common[@]}" --set data.seq_len="$L" \
      --set recompute=offload --set out_dir=/tmp/lc/1b5_${L}_o
  done
fi
if [ "$MODE" = 9b ] || [ "$MODE" = all ]; then
  for L in ${LC_LENS9:-65536}; do
    run "9b_${L}_offload" 560 configs/llama_9b_250k_8k.json "${common[@]}" --set data.seq_len="$L" \
      --set recompute=offload --set optimizer.state_dtype=bf16 --set optimizer.gradients=host \
      --set out_dir=/tmp/lc/9b_${L}
  done
fi
echo
echo "| run | rc | steps | loss | tok/s | NVML peak | Kestrel footprint peak | optimizer, GPU idle | host | plan |"
for r in "${rows[@]}"; do echo "$r"; done
