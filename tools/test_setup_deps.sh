#!/usr/bin/env bash
# Tests tools/setup_deps.sh by simulating machines (issue 18 item 6): PATH points at a fake bin
# folder holding links to this machine's tools minus the ones a case removes, a fake apt-get that
# records its calls (failing like an unreachable registry, or "succeeding" without installing),
# a dpkg that knows no packages (tools from pip, conda or a vendor build) and, for one case, an id
# that says "not root". Needs the real tools (cmake >= 3.25, ninja, g++ and the libraries) here.
# Run: bash tools/test_setup_deps.sh (also run by the CPU suite: tests/train/test_setup_deps.cpp).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
T=$(mktemp -d "${TMPDIR:-/tmp}/kestrel_setup_test.XXXXXX")
trap 'rm -rf "$T"' EXIT
failures=0

for tool in cmake ninja g++; do
  command -v "$tool" >/dev/null 2>&1 || { echo "[test_setup_deps] SKIP: $tool is not installed here"; exit 0; }
done
REAL_CMAKE=$(command -v cmake)
REAL_NINJA=$(command -v ninja)

# put_script FILE TEXT: FILE becomes an executable script. The link there (into this machine's real
# bin folders) is removed first: writing through it would overwrite the real tool.
put_script() {
  rm -f "$1"
  [ ! -e "$1" ] && [ ! -L "$1" ] || { echo "[test_setup_deps] cannot replace $1"; exit 1; }
  printf '%s' "$2" >"$1"
  chmod +x "$1"
}

# This machine's executables (the first of each name on PATH), linked once into $T/base.
mkdir -p "$T/base"
IFS=: read -r -a path_dirs <<<"$PATH"
for ((i = ${#path_dirs[@]} - 1; i >= 0; --i)); do  # last first: earlier folders replace its links
  [ -d "${path_dirs[$i]}" ] && cp -sf "${path_dirs[$i]}"/* "$T/base/" 2>/dev/null
done
rm -f "$T/base/cmake" "$T/base/ninja" "$T/base/apt-get" "$T/base/dpkg" "$T/base/sudo"

# make_machine NAME [tool to leave out]...: $T/NAME/bin with the base's links minus those named,
# plus the fakes; cmake and ninja live in $T/NAME/pip/bin as pip puts them.
make_machine() {
  local name=$1 m=$T/$1 f
  shift
  mkdir -p "$m/pip/bin"
  cp -a "$T/base" "$m/bin"
  ln -s "$REAL_CMAKE" "$m/pip/bin/cmake"
  ln -s "$REAL_NINJA" "$m/pip/bin/ninja"
  for f in "$@"; do rm -f "$m/bin/$f" "$m/pip/bin/$f"; done
  put_script "$m/bin/dpkg" $'#!/bin/sh\nexit 1\n'
  apt_fails "$name"
}

# The machine's apt-get: records "apt-get ARGS" in apt.log, then fails (exit 100, no registry).
apt_fails() {
  put_script "$T/$1/bin/apt-get" "#!/bin/sh
echo \"apt-get \$*\" >>\"$T/$1/apt.log\"
echo 'E: Failed to fetch (simulated: no registry)' >&2
exit 100
"
}
# ... or "succeeds" without installing anything (the library stays missing: the re-check notices).
apt_succeeds() {
  put_script "$T/$1/bin/apt-get" "#!/bin/sh
echo \"apt-get \$*\" >>\"$T/$1/apt.log\"
exit 0
"
}

# run_case NAME EXPECTED_RC SET [ENV=VALUE...]: runs kestrel_setup_deps SET on machine NAME.
run_case() {
  local name=$1 want=$2 set=$3
  shift 3
  local m=$T/$name
  env -i HOME="$HOME" TMPDIR="${TMPDIR:-/tmp}" PATH="$m/pip/bin:$m/bin" KESTREL_CUDA=OFF "$@" \
    bash -c 'set -euo pipefail; cd "$1"; source tools/setup_deps.sh; kestrel_setup_deps "$2"' _ "$ROOT" "$set" \
    >"$m/out" 2>&1
  local rc=$?
  if [ "$rc" != "$want" ]; then
    echo "[test_setup_deps] FAIL $name: exit $rc, expected $want; output:"
    sed 's/^/    /' "$m/out"
    failures=$((failures + 1))
  fi
}
expect_out() {  # NAME TEXT: the case's output holds TEXT
  grep -qF -- "$2" "$T/$1/out" || { echo "[test_setup_deps] FAIL $1: output lacks '$2':"; sed 's/^/    /' "$T/$1/out"; failures=$((failures + 1)); }
}
expect_no_apt() {
  [ ! -e "$T/$1/apt.log" ] || { echo "[test_setup_deps] FAIL $1: apt-get was called: $(cat "$T/$1/apt.log")"; failures=$((failures + 1)); }
}

# 1. The issue's GPU box: cmake and ninja from pip, no Debian packages, apt-get cannot reach a
#    registry. Everything is present, so set-up goes on without calling apt-get.
make_machine pip_all_present
run_case pip_all_present 0 all
expect_no_apt pip_all_present
run_case pip_all_present 0 quickstart
expect_no_apt pip_all_present

# 2. ninja missing and apt-get failing: names ninja and how to get it, exits 1.
make_machine no_ninja ninja
run_case no_ninja 1 quickstart
expect_out no_ninja "ninja (no ninja on PATH)"
expect_out no_ninja "pip install ninja"
expect_out no_ninja "apt-get could not install them"
grep -q "install.* ninja-build" "$T/no_ninja/apt.log" 2>/dev/null || grep -q "update" "$T/no_ninja/apt.log" ||
  { echo "[test_setup_deps] FAIL no_ninja: apt-get was not tried"; failures=$((failures + 1)); }

# 3. The same with the hook switching apt-get off: not called at all, and the message says why.
make_machine no_apt ninja
run_case no_apt 1 quickstart KESTREL_SETUP_NO_APT=1
expect_no_apt no_apt
expect_out no_apt "ninja (no ninja on PATH)"
expect_out no_apt "KESTREL_SETUP_NO_APT is set"

# 4. A cmake older than 3.25 first on PATH.
make_machine old_cmake
put_script "$T/old_cmake/pip/bin/cmake" $'#!/bin/sh\necho "cmake version 3.22.1"\n'
run_case old_cmake 1 quickstart KESTREL_SETUP_NO_APT=1
expect_out old_cmake "cmake >= 3.25 (found 3.22.1"

# 5. GoogleTest missing, apt-get works: only GoogleTest's packages are asked for (nothing that is
#    present), and the re-check after installing still sees what is missing.
make_machine no_gtest
apt_succeeds no_gtest
run_case no_gtest 1 all KESTREL_SETUP_PROBE_ARGS=-DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON
expect_out no_gtest "installing Debian packages: libgtest-dev libgmock-dev"
expect_out no_gtest "GoogleTest (headers and libraries)"
if grep -q "install" "$T/no_gtest/apt.log" && grep "install" "$T/no_gtest/apt.log" | grep -qE "cmake|ninja|g\+\+|nlohmann|libpng|benchmark"; then
  echo "[test_setup_deps] FAIL no_gtest: installed more than GoogleTest: $(cat "$T/no_gtest/apt.log")"
  failures=$((failures + 1))
fi
# ... and the quickstart, which builds no tests, does not need it.
rm -f "$T/no_gtest/apt.log"
run_case no_gtest 0 quickstart KESTREL_SETUP_PROBE_ARGS=-DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON
expect_no_apt no_gtest

# 6. Not root and no sudo: apt-get is not usable; the message lists the missing library.
make_machine not_root
put_script "$T/not_root/bin/id" $'#!/bin/sh\necho 1000\n'
run_case not_root 1 quickstart KESTREL_SETUP_PROBE_ARGS=-DCMAKE_DISABLE_FIND_PACKAGE_PNG=ON
expect_no_apt not_root
expect_out not_root "libpng (headers and library): apt-get install libpng-dev"
expect_out not_root "apt-get is not usable here"

# 7. A bare Debian machine (CI): apt-get installs ninja (the fake links it in), then the libraries
#    are probed and GoogleTest's packages asked for in a second round, without a second update.
make_machine bare ninja
put_script "$T/bare/bin/apt-get" "#!/bin/sh
echo \"apt-get \$*\" >>\"$T/bare/apt.log\"
case \" \$* \" in *' ninja-build '*) ln -s '$REAL_NINJA' '$T/bare/bin/ninja' ;; esac
exit 0
"
run_case bare 1 all KESTREL_SETUP_PROBE_ARGS=-DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON
if [ "$(grep -c update "$T/bare/apt.log")" != 1 ] || ! grep -q "install.* ninja-build$" "$T/bare/apt.log" ||
    ! grep -q "install.* libgtest-dev libgmock-dev$" "$T/bare/apt.log"; then
  echo "[test_setup_deps] FAIL bare: expected one update, then ninja-build, then GoogleTest; apt-get saw:"
  sed 's/^/    /' "$T/bare/apt.log"
  failures=$((failures + 1))
fi
expect_out bare "GoogleTest (headers and libraries)"

if [ $failures -gt 0 ]; then
  echo "[test_setup_deps] $failures failure(s)"
  exit 1
fi
echo "[test_setup_deps] PASS: 7 simulated machines"
