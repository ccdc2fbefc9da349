#!/usr/bin/env bash
# The one-call GPU check for the device machine: runs the GPU test binaries, the quickstart on the
# GPU, the comparison with Hugging Face transformers, and the benchmarks next to PyTorch; writes
# logs under $OUT and prints a summary table last.
#
# usage: tools/gpu-check.sh BIN_DIR [tests|final|full]
#   BIN_DIR holds libkestrel.so, the test/bench binaries, kestrel-train and kestrel-grad (built on a
#   machine with nvcc: tools/gpu-build.sh). "tests" skips the benchmarks; "final" runs the memory
#   plan/profile and the attention and runtime benchmarks (not the fused CE and op benchmarks), to
#   stay inside one 10-minute device call.
set -u
cd "$(dirname "$0")/.."
B=$(realpath "${1:-.carry}")
MODE=${2:-full}
RESULTS=${OUT:-/tmp/kestrel-gpu-check}  # what comes back: logs.txt + a few reports
OUT=/tmp/kestrel-gpu-logs                # one log per step (the device tool returns at most 8 files)
mkdir -p "$OUT" "$RESULTS"
export LD_LIBRARY_PATH=$B:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"

names=()
codes=()
secs=()
step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 limit=$2
  shift 2
  local t0=$(date +%s%N)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local t1=$(date +%s%N)
  names+=("$name")
  codes+=("$rc")
  secs+=("$(( (t1 - t0) / 1000000 ))")
  echo "== $name: exit $rc"
  tail -n 4 "$OUT/$name.log"
}

for t in test_runtime_cuda test_ops_cuda test_models_cuda test_train_cuda; do
  [ -x "$B/$t" ] && step "$t" 240 "$B/$t" --gtest_brief=1
done
step quickstart_gpu 120 "$B/kestrel-train" --config configs/quickstart_vlm.json --set out_dir="$OUT/quickstart" \
  --set device=cuda
step compare_hf 120 python3 tools/compare_hf.py --kestrel-grad "$B/kestrel-grad" --out "$OUT/compare_hf"

if [ "$MODE" = full ] || [ "$MODE" = final ]; then
  step mem_plan_1b 60 "$B/kestrel-mem" plan --config configs/vlm_1b_8k.json
  step mem_profile_1b 120 "$B/kestrel-mem" profile --config configs/vlm_1b_8k.json --steps 2 --out "$OUT/mem_1b"
  # T=8192 rows only here; the full T sweep is bench/notes/flash_attention.md.
  step bench_flash_attention 90 "$B/bench_flash_attention" --benchmark_filter='T:8192/' --benchmark_min_warmup_time=0.3 \
    --benchmark_out="$OUT/bench_fa.json" --benchmark_out_format=json
  step torch_attention 120 python3 bench/attention_vs_torch.py --quick --kestrel kestrel="$OUT/bench_fa.json"
  step bench_cuda_runtime 60 "$B/bench_cuda_runtime" "$OUT/alloc_trace.txt"
  step torch_alloc_trace 60 python3 bench/alloc_trace_vs_torch.py "$OUT/alloc_trace.txt"
fi
if [ "$MODE" = full ]; then
  step bench_fused_ce 90 "$B/bench_fused_linear_cross_entropy"
  step torch_fused_ce 90 python3 bench/fused_ce_vs_torch.py
  step bench_ops 60 "$B/bench_ops" --benchmark_out="$OUT/bench_ops.json" --benchmark_out_format=json
  step torch_ops 60 python3 bench/ops_vs_torch.py --kestrel "$OUT/bench_ops.json"
fi

echo
echo "== summary ($(cat "$OUT/gpu.txt"))"
printf '%-26s %6s %8s\n' step exit ms
for i in "${!names[@]}"; do printf '%-26s %6s %8s\n' "${names[$i]}" "${codes[$i]}" "${secs[$i]}"; done
grep -h -E "held-out captions|trained [0-9]+ steps" "$OUT/quickstart_gpu.log" 2>/dev/null
tail -n 12 "$OUT/mem_plan_1b.log" "$OUT/mem_profile_1b.log" 2>/dev/null
tail -n 6 "$OUT/compare_hf.log" 2>/dev/null
tail -n 24 "$OUT/torch_attention.log" 2>/dev/null
grep -h "^|" "$OUT/bench_cuda_runtime.log" "$OUT/torch_alloc_trace.log" 2>/dev/null

# Gather: every step's log into one file, plus the 1B memory report.
for i in "${!names[@]}"; do
  echo "=================== ${names[$i]} (exit ${codes[$i]}, ${secs[$i]} ms)"
  cat "$OUT/${names[$i]}.log"
done >"$RESULTS/logs.txt"
cp "$OUT/gpu.txt" "$RESULTS/" 2>/dev/null
cp "$OUT/mem_1b/memory.json" "$OUT/mem_1b/memory.html" "$RESULTS/" 2>/dev/null
cp "$OUT/quickstart/memory_report.json" "$RESULTS/quickstart_memory_report.json" 2>/dev/null
true
