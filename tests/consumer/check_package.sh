#!/usr/bin/env bash
# Checks the installable package of an already built tree, without rebuilding the library:
#   1. cmake --install BUILD_DIR into a temporary prefix, then moves the prefix (relocatable?);
#   2. configures, builds and runs tests/consumer against it with find_package(kestrel CONFIG);
#   3. compiles and runs minimal.cpp (README's example) with only `pkg-config --cflags --libs kestrel`.
# Fails (non-zero) when any step fails. Usage: tests/consumer/check_package.sh BUILD_DIR
set -euo pipefail
build_dir=$(cd "${1:?usage: check_package.sh BUILD_DIR}" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kestrel-package.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

echo "[package] installing $build_dir into a temporary prefix"
cmake --install "$build_dir" --prefix "$tmp/staged" >"$tmp/install.log"
mv "$tmp/staged" "$tmp/prefix"  # consumers must work from wherever the tree ends up
prefix=$tmp/prefix
lib=$(dirname "$(find "$prefix" -name libkestrel.so -print -quit)")
echo "[package] $(find "$prefix" -type f | wc -l) files; libkestrel.so RUNPATH: $(readelf -d "$lib/libkestrel.so" | sed -n 's/.*R\(UN\)\?PATH.*\[\(.*\)\]/\2/p')"
if find "$prefix/include" -name '*.h' -print0 | xargs -0 grep -l '#include "\(cpu\|cuda\|src\)/' | grep .; then
  echo "[package] installed headers include private headers"; exit 1
fi
# The public surface: CUDA types only in the optional kestrel/cuda/ component (a CPU build installs
# none of it), and every other installed header compiles on its own from the install tree alone
# (no header it needs was left behind as internal).
if find "$prefix/include" -name '*.h' -not -path '*/kestrel/cuda/*' -print0 |
   xargs -0 grep -l '#include <\(cuda\|cublas\|cudnn\|nccl\)' | grep .; then
  echo "[package] installed headers outside kestrel/cuda/ include CUDA headers"; exit 1
fi
if [ -d "$prefix/include/kestrel/cuda" ] && ! grep -q 'WITH_CUDA=1' "$lib/pkgconfig/kestrel.pc"; then
  echo "[package] a CPU-only build installed the kestrel/cuda/ component"; exit 1
fi
# cuBLASLt is opened at run time (kestrel/cuda/cublaslt_api.h): a load-time dependency would cost every
# process its ~0.4 s static initialisation again.
if readelf -d "$lib/libkestrel.so" | grep 'NEEDED' | grep -i 'cublas'; then
  echo "[package] libkestrel.so needs cuBLAS at load time (it must open cuBLASLt with cuda::cublaslt_api())"; exit 1
fi

echo "[package] consumer via find_package(kestrel CONFIG)"
cmake -S "$here" -B "$tmp/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" >"$tmp/configure.log" ||
  { cat "$tmp/configure.log"; exit 1; }
grep -- "-- kestrel" "$tmp/configure.log" || true
cmake --build "$tmp/consumer"
"$tmp/consumer/kestrel_consumer"

echo "[package] consumer via pkg-config"
export PKG_CONFIG_PATH=$lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
cflags=$(pkg-config --cflags kestrel)
# One compiler per core (the headers are independent; one by one this was most of the step).
check_header() {  # $1: the header, relative to include/
  local src=$tmp/header_${1//\//_}.cpp
  printf '#include <%s>\n#include <%s>\n' "$1" "$1" >"$src"  # twice: include guards too
  # shellcheck disable=SC2086
  ${CXX:-c++} -std=c++20 -fsyntax-only $cflags "$src" ||
    { echo "[package] installed header $1 does not compile on its own"; return 1; }
}
export -f check_header
export tmp cflags
headers=$(cd "$prefix/include" && find kestrel -name '*.h' -not -path 'kestrel/cuda/*' | sort)
n=$(printf '%s\n' "$headers" | grep -c .)
printf '%s\n' "$headers" | xargs -P "$(nproc)" -n 1 bash -c 'check_header "$0"' ||
  { echo "[package] installed headers do not compile on their own (above)"; exit 1; }
echo "[package] $n installed headers compile on their own; kestrel/cuda/: $(ls "$prefix/include/kestrel/cuda" 2>/dev/null | tr '\n' ' ')"
flags=$(pkg-config --cflags --libs kestrel)
echo "pkg-config --cflags --libs kestrel: $flags"
# shellcheck disable=SC2086
${CXX:-c++} -std=c++20 -O1 "$here/minimal.cpp" -o "$tmp/minimal" $flags -Wl,-rpath,"$lib"
"$tmp/minimal"
echo "[package] ok"
