#!/usr/bin/env bash
# The main job: set up (install missing Debian packages, configure, build) and train the bundled
# tiny vision-language model on the embedded synthetic shapes dataset — on the GPU when there is
# one, else on the CPU — printing the loss curve and sample captions, and writing a memory report.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup_deps.sh
kestrel_setup_deps
BUILD_DIR=${KESTREL_BUILD_DIR:-build}
kestrel_configure_and_build "$BUILD_DIR" -DKESTREL_BUILD_TESTS=OFF -DKESTREL_BUILD_BENCH=OFF
OUT_DIR=${KESTREL_OUT_DIR:-runs/quickstart}
mkdir -p "$OUT_DIR"
if [ -x "$BUILD_DIR/kestrel-train" ] && [ -f configs/quickstart_vlm.json ]; then
  "$BUILD_DIR/kestrel-train" --config configs/quickstart_vlm.json --set out_dir="$OUT_DIR" "$@"
else
  echo "[quickstart] the trainer is not built yet: running the autograd demo instead (a small MLP)"
  "$BUILD_DIR/kestrel-demo" --out "$OUT_DIR" "$@"
fi
