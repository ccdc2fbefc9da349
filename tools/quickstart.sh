#!/usr/bin/env bash
# The main job: set up (check the tools and libraries, install only what is missing, configure,
# build) and train the bundled tiny vision-language model on the embedded synthetic shapes
# dataset — on the GPU when there is one, else on the CPU — printing the loss curve, periodic
# greedy captions, the held-out caption accuracy, and writing a memory report.
# configs/quickstart_vlm.json holds one schedule per device (its on_cpu / on_cuda entries: a
# smaller, shorter run on two CPU cores; more samples on a GPU).
# Extra arguments go to kestrel-train (e.g. --set device=cpu to train on the CPU anyway).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup_deps.sh
kestrel_setup_deps quickstart  # no tests or benchmarks: GoogleTest, Benchmark, pkg-config not needed
BUILD_DIR=${KESTREL_BUILD_DIR:-build}
kestrel_configure_and_build "$BUILD_DIR" -DKESTREL_BUILD_TESTS=OFF -DKESTREL_BUILD_BENCH=OFF
OUT_DIR=${KESTREL_OUT_DIR:-runs/quickstart}
mkdir -p "$OUT_DIR"
if [ ! -x "$BUILD_DIR/kestrel-train" ] || [ ! -f configs/quickstart_vlm.json ]; then
  echo "[quickstart] the trainer is not built yet: running the autograd demo instead (a small MLP)"
  exec "$BUILD_DIR/kestrel-demo" --out "$OUT_DIR" "$@"
fi
start=$(date +%s.%N)
"$BUILD_DIR/kestrel-train" --config configs/quickstart_vlm.json --set out_dir="$OUT_DIR" "$@" 2>&1 | tee "$OUT_DIR/quickstart.log"
end=$(date +%s.%N)
# The quickstart's figures: the loss must fall below 10% of its start and >= 90% of the held-out
# captions must be exactly right (colour, shape and position).
awk -v t0="$start" -v t1="$end" '
  /^trained / { for (i = 1; i <= NF; ++i) if ($i ~ /^\(/) { ratio = substr($i, 2) + 0 } }
  /^held-out captions:/ { acc = $3 + 0 }
  END {
    ok = (ratio > 0 && ratio < 10 && acc >= 90)
    printf "[quickstart] %.0f s in all (build excluded): loss at %.1f%% of its start (needs < 10%%), held-out captions %.1f%% right (needs >= 90%%): %s\n",
           t1 - t0, ratio, acc, ok ? "PASS" : "FAIL"
    exit ok ? 0 : 1
  }' "$OUT_DIR/quickstart.log"
