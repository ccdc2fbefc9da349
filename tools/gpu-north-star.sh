#!/usr/bin/env bash
# The north-star runs on the device machine in one call: the optimizer-offload GPU/CPU tests, then
# kestrel-train runs observed through NVML (bench/train_memory_run.py), a summary table last.
#
# usage: tools/gpu-north-star.sh BIN_DIR [tests|small|first|second|all]
#   BIN_DIR: libkestrel.so, kestrel-train, test_train, test_train_cuda, test_runtime.
#   tests  : the offload tests only
#   small  : tests + the 1.5B decoder at 8k, optimizer.offload none vs host
#   first  : small + the 9B / 250k / 8k decoder inside 40 GiB, accumulation 1 (NS_STEPS1 steps, 12)
#   second : the 9B inside 40 GiB, accumulation 1 (NS_STEPS1, 20) and 8 (NS_STEPS8, 4)
#   all    : small + second
#   acc8   : tests + the 9B inside 40 GiB at accumulation 8 (NS_STEPS8 steps), with its plan
#   compact: the compact-optimizer tests (q8 moments, bf16 without master, step in backward: issue 21),
#            the plan, then the 9B / 250k / 8k decoder inside 24 GiB (configs/llama_9b_250k_8k_compact.json,
#            NS_STEPSC steps, default 20); NS_SET="train.batch_size=2" for two 8k sequences per step
#   quality: the 1.5B decoder on the Python stdlib (byte tokens), 300 steps (NS_STEPSQ) of exact AdamW and of
#            the compact mode, both curves in bench/compact_quality.svg (bench/quality_ab.py with its defaults)
# Environment: NS_SET="k=v k=v" extra --set entries for every run.
# Building BIN on the device (about 45 s on its 16 cores), from the repository root:
#   cmake -S . -B /tmp/b -G Ninja -DCMAKE_BUILD_TYPE=Release -DKESTREL_CUDA=ON -DKESTREL_BUILD_TESTS=ON &&
#   cmake --build /tmp/b -j16 --target kestrel kestrel-train kestrel-mem test_train test_train_cuda test_runtime \
#     test_ops test_ops_cuda && mkdir -p /tmp/c && cp /tmp/b/libkestrel.so /tmp/b/kestrel-train /tmp/b/kestrel-mem \
#     /tmp/b/tests/test_* /tmp/c/ && NS_STEPS8=4 bash tools/gpu-north-star.sh /tmp/c acc8
set -u
cd "$(dirname "$0")/.."
B=$(realpath "${1:-.carry}")
MODE=${2:-first}
RESULTS=${OUT:-/tmp/kestrel-north-star}
LOGS=/tmp/kestrel-ns-logs
mkdir -p "$RESULTS" "$LOGS"
export LD_LIBRARY_PATH=$B:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
echo "host: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2 " GiB RAM, " $7 " GiB available"}'), THP $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)"
extra=()
for kv in ${NS_SET:-}; do extra+=(--set "$kv"); done
rows=()
run() {  # run LABEL TIMEOUT CONFIG [--set k=v ...]
  local label=$1 limit=$2 cfg=$3
  shift 3
  timeout "$limit" python3 bench/train_memory_run.py --bin "$B" --config "$cfg" --label "$label" \
    --json "$LOGS/$label.json" "$@" "${extra[@]}" >"$LOGS/$label.log" 2>&1
  echo "== $label: exit $?"
  grep -E "^step|OutOfBudget|error|Error" "$LOGS/$label.log" | tail -n 4
  rows+=("$(grep '^| ' "$LOGS/$label.log" | tail -n 1)")
}

"$B/test_runtime" --gtest_brief=1 --gtest_filter='ParallelFor*' 2>&1 | tail -n 3
"$B/test_train" --gtest_brief=1 --gtest_filter='AdamWOffload*' 2>&1 | tail -n 3
"$B/test_train_cuda" --gtest_brief=1 --gtest_filter='AdamWOffload*' 2>&1 | tail -n 3
# The in-place accumulation of the vocabulary-sized gradients and the lse-based fused CE backward.
[ -x "$B/test_ops_cuda" ] && "$B/test_ops_cuda" --gtest_brief=1 \
  --gtest_filter='FusedCrossEntropyBackwardCuda*:EmbeddingCuda*:CudaOpTable*:*FusedLinearCrossEntropy*' 2>&1 | tail -n 4
if [ "$MODE" = compact ]; then
  [ -x "$B/test_ops" ] && "$B/test_ops" --gtest_brief=1 --gtest_filter='Q8Code*:AdamWQ8*:AdamWNoMaster*:AdamW.*' 2>&1 | tail -n 3
  "$B/test_ops_cuda" --gtest_brief=1 --gtest_filter='CudaParity.AdamW*' 2>&1 | tail -n 3
  "$B/test_train" --gtest_brief=1 --gtest_filter='AdamWCompact*' 2>&1 | tail -n 3
  "$B/test_train_cuda" --gtest_brief=1 --gtest_filter='AdamWCompactCuda*' 2>&1 | tail -n 3
fi
[ "$MODE" = tests ] && exit 0

S1=${NS_STEPS1:-12}
S8=${NS_STEPS8:-4}
if [ "$MODE" = quality ]; then
  timeout 590 python3 bench/quality_ab.py --bin "$B" --steps "${NS_STEPSQ:-300}" 2>&1 | grep -v "^step" | tail -n 12
  exit 0
fi
if [ "$MODE" = compact ]; then
  "$B/kestrel-mem" plan --config configs/llama_9b_250k_8k_compact.json 2>&1 | tee "$LOGS/plan_9b_compact.log" | tail -n 16
  run 9b_24g_compact 420 configs/llama_9b_250k_8k_compact.json --set train.steps="${NS_STEPSC:-20}" \
    --warmup 1 --set out_dir=runs/9b_compact
fi
if [ "$MODE" != second ] && [ "$MODE" != acc8 ] && [ "$MODE" != compact ]; then
  run 1b5_none 150 configs/llama_1b5_8k.json --set train.steps=10 --set optimizer.offload=none --set out_dir=runs/1b5_none
  run 1b5_host 150 configs/llama_1b5_8k.json --set train.steps=10 --set optimizer.offload=host --set out_dir=runs/1b5_host
fi
if [ "$MODE" = acc8 ]; then
  "$B/kestrel-mem" plan --config configs/llama_9b_250k_8k.json --set train.grad_accum=8 2>&1 | tail -n 14
  run 9b_40g_acc8 300 configs/llama_9b_250k_8k.json --set train.steps="$S8" --set train.grad_accum=8 \
    --warmup 1 --set train.warmup_steps=1 --set out_dir=runs/9b_acc8
fi
if [ "$MODE" = first ]; then
  run 9b_40g_acc1 300 configs/llama_9b_250k_8k.json --set train.steps="$S1" --set out_dir=runs/9b_acc1
fi
if [ "$MODE" = second ] || [ "$MODE" = all ]; then
  timeout 60 python3 bench/offload_designs.py 2>&1 | tee "$LOGS/designs.log"
  "$B/kestrel-mem" plan --config configs/llama_9b_250k_8k.json 2>&1 | tee "$LOGS/plan_9b.log"
  S1=${NS_STEPS1:-20}
  run 9b_40g_acc1 240 configs/llama_9b_250k_8k.json --set train.steps="$S1" --set out_dir=runs/9b_acc1
  run 9b_40g_acc8 240 configs/llama_9b_250k_8k.json --set train.steps="$S8" --set train.grad_accum=8 \
    --warmup 1 --set train.warmup_steps=1 --set out_dir=runs/9b_acc8
  # The anchor in the same call: the state on the device, no budget (needs ~137 GiB).
  [ -n "${NS_ANCHOR:-}" ] && run 9b_none_acc8 150 configs/llama_9b_250k_8k.json --set train.steps=3 \
    --set train.grad_accum=8 --warmup 1 --set train.warmup_steps=1 --set optimizer.offload=none \
    --set memory_budget= --set out_dir=runs/9b_none_acc8
fi
echo
echo "== summary"
for r in "${rows[@]}"; do echo "$r"; done
cat "$LOGS"/*.log >"$RESULTS/runs.log" 2>/dev/null
cp "$LOGS"/*.json "$RESULTS/" 2>/dev/null
true
