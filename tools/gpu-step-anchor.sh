#!/usr/bin/env bash
# Step throughput with its same-run PyTorch anchor (issue 23), on the device machine:
# Kestrel's 1.5B at 8k in bf16 and with FP8 linear layers, each under recompute selective / none / full,
# and the 9B / 250k at 8k (unconstrained, full recompute, exact AdamW on the device) in bf16 and FP8;
# then PyTorch eager (and torch.compile with STEP_COMPILE=1) on the same shapes (bench/step_vs_torch.py).
# Every Kestrel row carries tok/s, MFU ((6 x parameters x tokens + attention FLOPs) / time / bf16 peak,
# recompute not counted) and the NVML peak.
# usage: tools/gpu-step-anchor.sh BIN_DIR [1b5|9b|all|9b40]   (BIN_DIR: libkestrel.so and kestrel-train)
#   9b40: the 9B / 250k at 8k inside the 40 GiB budget instead (configs/llama_9b_250k_8k.json: full recompute,
#         optimizer state on the host, accumulation 8), bf16 and FP8 (STEP_STEPS40 steps, default 4).
# Environment: STEP_SET="k=v ..." extra --set entries for the Kestrel runs; STEP_COMPILE=1 adds the
# torch.compile rows; STEP_TORCH=0 skips PyTorch; STEP_PRECISIONS="bf16 fp8" (default both).
set -u
cd "$(dirname "$0")/.."
B=$(realpath "$1")
MODE=${2:-all}
export LD_LIBRARY_PATH=$B:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
extra=()
for kv in ${STEP_SET:-}; do extra+=(--set "$kv"); done
compile=()
[ "${STEP_COMPILE:-0}" = 1 ] && compile=(--compile)
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
fp8_set() { [ "$1" = fp8 ] && echo "--set fp8.enabled=true" || echo "--set fp8.enabled=false"; }
if [ "$MODE" = 1b5 ] || [ "$MODE" = all ]; then
  for prec in ${STEP_PRECISIONS:-bf16 fp8}; do
    for r in selective none recompute; do
      # shellcheck disable=SC2046
      kes "1b5_${prec}_$r" 200 configs/llama_1b5_8k_selective_fp8.json $(fp8_set "$prec") --set recompute=$r \
        --set train.steps=8 --warmup 2 --set out_dir=runs/step_1b5_${prec}_$r
    done
  done
  if [ "${STEP_TORCH:-1}" = 1 ]; then
    timeout 420 python3 bench/step_vs_torch.py --config configs/llama_1b5_8k.json --modes amp:ckpt,amp:none,bf16:ckpt \
      --steps 6 --warmup 2 "${compile[@]}" 2>&1 | grep -v Warning | tail -n 6
  fi
fi
if [ "$MODE" = 9b40 ]; then
  for prec in ${STEP_PRECISIONS:-bf16 fp8}; do
    # shellcheck disable=SC2046
    kes "9b40_${prec}_acc8" 300 configs/llama_9b_250k_8k.json $(fp8_set "$prec") --set train.steps="${STEP_STEPS40:-4}" \
      --set train.grad_accum=8 --warmup 1 --set train.warmup_steps=1 --set out_dir=runs/step_9b40_$prec
  done
elif [ "$MODE" != 1b5 ]; then
  for prec in ${STEP_PRECISIONS:-bf16 fp8}; do
    # shellcheck disable=SC2046
    kes "9b_${prec}_full" 300 configs/llama_9b_250k_8k_step.json $(fp8_set "$prec") --set train.steps=6 --warmup 2
  done
  if [ "${STEP_TORCH:-1}" = 1 ]; then
    timeout 240 python3 bench/step_vs_torch.py --config configs/llama_9b_250k_8k_step.json --modes bf16:ckpt \
      --steps 3 --warmup 2 2>&1 | grep -v Warning | tail -n 3
  fi
fi
echo "Kestrel rows:"
printf '%s\n' "${rows[@]}"
