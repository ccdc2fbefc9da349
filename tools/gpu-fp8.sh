#!/usr/bin/env bash
# FP8 linear layers (issue 23) on the device machine in one call: the FP8 GPU tests, the bf16-vs-FP8
# linear benchmark at the 1.5B shapes, then the 1.5B decoder at 8k with selective recompute in bf16
# (configs/llama_1b5_8k_selective.json) and with fp8 on (configs/llama_1b5_8k_selective_fp8.json),
# FP8_STEPS steps each (default 20) through bench/train_memory_run.py, and a table: tok/s, step ms
# (medians after 2 warm-up steps), peak memory, and the losses of both runs side by side. With
# FP8_UNFUSED=1 a third run, fp8 with fp8.fused_casts=false (linear_fp8 casting the q/k/v, gate/up and
# down inputs itself instead of the norms and SwiGLU), for the A/B of the producer-fused casts; with
# FP8_SET=train.deterministic=true its losses equal fp8_fp8's bit for bit (else they differ as two runs
# of one config do, through attention's atomics).
#
# usage: tools/gpu-fp8.sh BIN_DIR
#   BIN_DIR (tools/gpu-build.sh's .carry): libkestrel.so, kestrel-train, test_ops_cuda, test_models_cuda,
#   test_train_cuda, bench_fp8_linear.
# Environment: FP8_STEPS (20), FP8_SET="k=v k=v" extra --set entries for every run, FP8_SKIP_TESTS=1,
# FP8_SKIP_BF16=1 (no bf16 run), FP8_UNFUSED=1.
set -u
cd "$(dirname "$0")/.."
B=$(realpath "${1:-.carry}")
STEPS=${FP8_STEPS:-20}
LOGS=/tmp/kestrel-fp8-logs
RESULTS=${OUT:-/tmp/kestrel-fp8}
rm -rf "$LOGS" runs/fp8_bf16 runs/fp8_fp8 runs/fp8_unfused
mkdir -p "$LOGS" "$RESULTS"
export LD_LIBRARY_PATH=$B:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
extra=()
for kv in ${FP8_SET:-}; do extra+=(--set "$kv"); done

if [ "${FP8_SKIP_TESTS:-0}" != 1 ]; then
  for t in "test_ops_cuda:Fp8*:LinearFp8*" "test_models_cuda:Fp8*" "test_train_cuda:Fp8*:MemoryPlanCuda.MatchesProfileWithFp8"; do
    bin=${t%%:*} filter=${t#*:}
    [ -x "$B/$bin" ] || { echo "== $bin missing"; continue; }
    echo "== $bin --gtest_filter=$filter"
    timeout 500 "$B/$bin" --gtest_filter="$filter" >"$LOGS/$bin.log" 2>&1
    echo "exit $?"
    grep -E "^\[  (PASSED|FAILED)|Failure|rel L2|worst|step [0-9]+:|last 10" "$LOGS/$bin.log" | head -n 80
  done
fi

if [ -x "$B/bench_fp8_linear" ]; then
  echo "== bench_fp8_linear (T = 8192)"
  timeout 300 "$B/bench_fp8_linear" --benchmark_counters_tabular=true 2>&1 | grep -E "^BM_|^Benchmark|TFLOP|GB/s" | tee "$LOGS/bench.log"
fi

run() {  # run LABEL CONFIG [--set K=V ...]
  local label=$1 cfg=$2
  shift 2
  timeout 400 python3 bench/train_memory_run.py --bin "$B" --config "$cfg" --label "$label" --json "$LOGS/$label.json" \
    --set train.steps="$STEPS" --set out_dir="runs/$label" "${extra[@]}" "$@" >"$LOGS/$label.log" 2>&1
  echo "== $label ($cfg): exit $?"
  grep -E "^step|OutOfBudget|rror" "$LOGS/$label.log" | tail -n 3
}
[ "${FP8_SKIP_BF16:-0}" = 1 ] || run fp8_bf16 configs/llama_1b5_8k_selective.json
run fp8_fp8 configs/llama_1b5_8k_selective_fp8.json
[ "${FP8_UNFUSED:-0}" = 1 ] && run fp8_unfused configs/llama_1b5_8k_selective_fp8.json --set fp8.fused_casts=false

echo
echo "== summary ($STEPS steps; tok/s and ms: medians after 2 warm-up steps)"
python3 - "$LOGS" <<'PY'
import json, os, sys
logs = sys.argv[1]
def summary(label):
    p = os.path.join(logs, label + ".json")
    return json.load(open(p)) if os.path.exists(p) else {}
def metrics(label):
    p = os.path.join("runs", label, "metrics.jsonl")
    return [json.loads(l) for l in open(p) if l.strip()] if os.path.exists(p) else []
print("| run | tok/s | step ms | peak | first loss | last loss |")
print("|---|---|---|---|---|---|")
for l in ("fp8_bf16", "fp8_fp8", "fp8_unfused"):
    s, m = summary(l), metrics(l)
    if not s and not m:
        continue
    peak = s.get("kestrel_peak_footprint_gib") or s.get("nvml_peak_gib") or 0
    print(f"| {l} | {s.get('tok_s_median') or 0:.0f} | {s.get('step_ms_median') or 0:.1f} | {peak:.2f} GiB | "
          f"{m[0]['loss'] if m else 'n/a'} | {m[-1]['loss'] if m else 'n/a'} |")
a, b = metrics("fp8_bf16"), metrics("fp8_fp8")
if a and b:
    print("\nstep  bf16 loss  fp8 loss  rel diff")
    for i in range(min(len(a), len(b))):
        la, lb = a[i]["loss"], b[i]["loss"]
        print(f"{i + 1:4d}  {la:9.4f}  {lb:8.4f}  {(lb - la) / la:+.4f}")
c = metrics("fp8_unfused")
if b and c:
    same = [x["loss"] == y["loss"] for x, y in zip(b, c)]
    print(f"\nfp8 fused vs unfused casts: {sum(same)} of {len(same)} losses equal bit for bit")
PY
cp "$LOGS"/* "$RESULTS/" 2>/dev/null
true
