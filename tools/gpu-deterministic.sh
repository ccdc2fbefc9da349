#!/usr/bin/env bash
# The cost of train.deterministic (issue 18 item 7), on the device machine in one call: the
# determinism GPU tests, then the 1.5B decoder at 8k (configs/llama_1b5_8k.json, DET_STEPS steps,
# default 10) through bench/train_memory_run.py with train.deterministic false once (DET_OFF_RUNS,
# default 1; 2 shows the default's run-to-run drift) and true twice, and a table: tok/s and step
# time (median after 2 warm-up steps), the cost against the default, and whether the two
# deterministic runs' losses and gradient norms are bitwise equal (every step, and the final loss).
#
# usage: tools/gpu-deterministic.sh BIN_DIR
#   BIN_DIR: libkestrel.so, kestrel-train, and optionally test_ops_cuda, test_train_cuda.
# Environment: DET_STEPS (10), DET_OFF_RUNS (1), DET_SET="k=v k=v" extra --set entries for every run,
#   DET_RESUME=1 also trains a deterministic run to step min(DET_STEPS/2, 5), checkpoints it (~21 GB on
#   disk with the optimizer state) and resumes it to DET_STEPS, comparing every loss with the straight run.
# Building BIN on the device, from the repository root:
#   cmake -S . -B /tmp/b -G Ninja -DCMAKE_BUILD_TYPE=Release -DKESTREL_CUDA=ON -DKESTREL_BUILD_TESTS=ON &&
#   cmake --build /tmp/b -j16 --target kestrel kestrel-train test_ops_cuda test_train_cuda && mkdir -p /tmp/c &&
#   cp /tmp/b/libkestrel.so /tmp/b/kestrel-train /tmp/b/tests/test_ops_cuda /tmp/b/tests/test_train_cuda /tmp/c/ &&
#   bash tools/gpu-deterministic.sh /tmp/c
set -u
cd "$(dirname "$0")/.."
B=$(realpath "${1:-.carry}")
STEPS=${DET_STEPS:-10}
OFF_RUNS=${DET_OFF_RUNS:-1}
CFG=configs/llama_1b5_8k.json
LOGS=/tmp/kestrel-det-logs
RESULTS=${OUT:-/tmp/kestrel-deterministic}
rm -rf "$LOGS" runs/det_*
mkdir -p "$LOGS" "$RESULTS"
export LD_LIBRARY_PATH=$B:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
extra=()
for kv in ${DET_SET:-}; do extra+=(--set "$kv"); done

[ -x "$B/test_ops_cuda" ] && "$B/test_ops_cuda" --gtest_brief=1 \
  --gtest_filter='DeterministicCuda*:CudaParity.EmbeddingBackwardDeterministic:FlashAttention*Deterministic*' 2>&1 | tail -n 12
[ -x "$B/test_train_cuda" ] && "$B/test_train_cuda" --gtest_brief=1 --gtest_filter='DeterministicTrainingCuda*' 2>&1 | tail -n 12

labels=()
run() {  # run LABEL DETERMINISTIC [--set k=v ...]
  local label=$1 det=$2
  shift 2
  timeout 300 python3 bench/train_memory_run.py --bin "$B" --config "$CFG" --label "$label" --json "$LOGS/$label.json" \
    --set train.steps="$STEPS" --set train.deterministic="$det" --set out_dir="runs/$label" "$@" "${extra[@]}" \
    >"$LOGS/$label.log" 2>&1
  echo "== $label: exit $?"
  grep -E "^step|OutOfBudget|rror" "$LOGS/$label.log" | tail -n 3
  labels+=("$label")
}

for i in $(seq 1 "$OFF_RUNS"); do run "det_off_$i" false; done
run det_on_1 true
run det_on_2 true

if [ "${DET_RESUME:-0}" = 1 ]; then
  # One checkpoint only (~21 GB: bf16 weights + f32 master, m, v): train to the cut, then resume to
  # the end. The cut lies inside the config's 5 warm-up steps, where the learning rate does not depend
  # on train.steps (the cosine after it does), so stopping there is what the straight run did.
  half=$((STEPS / 2 < 5 ? STEPS / 2 : 5))
  cut=(--set train.deterministic=true --set out_dir=runs/det_cut "${extra[@]}")
  timeout 400 "$B/kestrel-train" --config "$CFG" "${cut[@]}" --set train.steps="$half" \
    --set checkpoint_every="$half" >"$LOGS/det_cut.log" 2>&1
  echo "== det_cut (to step $half, checkpointed): exit $?"
  timeout 400 "$B/kestrel-train" --config "$CFG" "${cut[@]}" --set train.steps="$STEPS" --set checkpoint_every=0 \
    --resume latest >>"$LOGS/det_cut.log" 2>&1
  echo "== det_cut resumed from step $half to $STEPS: exit $?"
  grep -E "^step|rror" "$LOGS/det_cut.log" | tail -n 3
  labels+=(det_cut)
fi

echo
echo "== summary ($STEPS steps of $CFG; tok/s and ms: medians after 2 warm-up steps)"
python3 - "$LOGS" "${labels[@]}" <<'EOF'
import json, os, sys
logs, labels = sys.argv[1], sys.argv[2:]

def metrics(label):
    p = os.path.join("runs", label, "metrics.jsonl")
    return [json.loads(l) for l in open(p) if l.strip()] if os.path.exists(p) else []

def summary(label):
    p = os.path.join(logs, label + ".json")
    return json.load(open(p)) if os.path.exists(p) else {}

rows = {l: metrics(l) for l in labels}
base = summary("det_off_1").get("tok_s_median") or 0
print("| run | deterministic | steps | tok/s | step ms | cost vs default | final loss |")
print("|---|---|---|---|---|---|---|")
for l in labels:
    s, m = summary(l), rows[l]
    tok = s.get("tok_s_median")
    cost = f"{100 * (base / tok - 1):+.1f}% time" if tok and base and not l.startswith("det_off") else ""
    print(f"| {l} | {'true' if l.startswith(('det_on', 'det_cut')) else 'false'} | {len(m)} | "
          f"{tok or 0:.0f} | {s.get('step_ms_median') or 0:.0f} | {cost} | {m[-1]['loss'] if m else 'n/a'!r} |")

def same(a, b, key):
    ra, rb = rows.get(a, []), rows.get(b, [])
    if not ra or len(ra) != len(rb):
        return f"n/a ({len(ra)} vs {len(rb)} steps)"
    diff = [i + 1 for i in range(len(ra)) if ra[i][key] != rb[i][key]]
    return "bitwise equal at every step" if not diff else f"DIFFER from step {diff[0]} ({len(diff)} steps)"

def final_equal(a, b):
    ra, rb = rows.get(a, []), rows.get(b, [])
    return bool(ra and rb and ra[-1]["loss"] == rb[-1]["loss"])

print()
print(f"deterministic runs, final loss bitwise equal: {final_equal('det_on_1', 'det_on_2')}")
print(f"deterministic runs, losses: {same('det_on_1', 'det_on_2', 'loss')}; grad norms: {same('det_on_1', 'det_on_2', 'grad_norm')}")
if "det_off_2" in rows:
    print(f"default runs (atomics), losses: {same('det_off_1', 'det_off_2', 'loss')}")
if "det_cut" in rows:
    print(f"resumed vs straight deterministic run, losses: {same('det_on_1', 'det_cut', 'loss')}")
EOF
cp "$LOGS"/* "$RESULTS/" 2>/dev/null
true
