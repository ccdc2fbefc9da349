#!/usr/bin/env bash
# Step throughput with its same-run PyTorch anchor (issue 23), on the device machine:
# Kestrel's 1.5B at 8k (recompute selective / none / full) and the 9B / 250k at 8k (unconstrained, full
# recompute, exact AdamW on the device), then PyTorch eager on the same shapes (bench/step_vs_torch.py).
# usage: tools/gpu-step-anchor.sh BIN_DIR [1b5|9b|all]   (BIN_DIR: libkestrel.so and kestrel-train)
# Environment: STEP_SET="k=v ..." extra --set entries for the Kestrel runs (e.g. fp8.enabled=true).
set -u
cd "$(dirname "$0")/.."
B=$(realpath "$1")
MODE=${2:-all}
export LD_LIBRARY_PATH=$B:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
extra=()
for kv in ${STEP_SET:-}; do extra+=(--set "$kv"); done
rows=()
kes() {  # kes LABEL TIMEOUT CONFIG [--set ...]
  local label=$1 limit=$2 cfg=$3
  shift 3
  timeout "$limit" python3 bench/train_memory_run.py --bin "$B" --config "$cfg" --label "$label" "$@" "${extra[@]}" \
    > "/tmp/step_$label.log" 2>&1
  echo "== $label: exit $?"
  grep -E "OutOfBudget|rror" "/tmp/step_$label.log" | tail -n 3
  rows+=("$(grep '^| ' "/tmp/step_$label.log" | tail -n 1)")
}
if [ "$MODE" != 9b ]; then
  for r in selective none recompute; do
    kes "1b5_$r" 200 configs/llama_1b5_8k_selective.json --set recompute=$r --set train.steps=10 --warmup 3 \
      --set out_dir=runs/step_1b5_$r
  done
  timeout 300 python3 bench/step_vs_torch.py --config configs/llama_1b5_8k.json --modes amp:ckpt,amp:none,bf16:ckpt \
    --steps 6 --warmup 2 2>&1 | grep -v Warning | tail -n 6
fi
if [ "$MODE" != 1b5 ]; then
  kes 9b_full 300 configs/llama_9b_250k_8k_step.json --set train.steps=7 --warmup 2
  timeout 240 python3 bench/step_vs_torch.py --config configs/llama_9b_250k_8k_step.json --modes bf16:ckpt \
    --steps 3 --warmup 2 2>&1 | grep -v Warning | tail -n 3
fi
echo "Kestrel rows:"
printf '%s\n' "${rows[@]}"
