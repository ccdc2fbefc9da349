#!/usr/bin/env bash
# Checks the layering the design states, from the #include lines alone (no build, about a second):
#   runtime <- autograd <- ops <- models <- train <- tools (and the umbrella include/)
# A file of one layer may include its own headers and the public headers (<layer>/include/) of the
# layers below it; it fails when
#   - an include resolves to a header of a layer above the file's own ("upward"), or
#   - it resolves to a private header (outside <layer>/include/) of another layer ("private");
# tests/ and bench/ may include any layer (private headers too, through their include folders), but
#   - never by a relative path that leaves tests/ or bench/ (e.g. "../../train/src/x.h": "relative").
# Includes are resolved as the compiler does with the library's include folders: a quoted include
# first next to the including file, then in each layer's include/ and private root, in layer order.
# Usage: tools/check_layers.sh [-q]   (-q: print only the count). Exit 1 when anything is found.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 - "$@" <<'PY'
import os, re, subprocess, sys

LAYERS = ["runtime", "autograd", "ops", "models", "train", "tools"]
RANK = {name: i for i, name in enumerate(LAYERS)}
RANK["include"] = RANK["tools"]  # the umbrella header sees every layer, as a tool does
FREE = {"tests", "bench"}        # may include any layer; only relative escapes are refused
SEARCH = []                      # the library's include folders, in the order CMake gives them
for layer in LAYERS[:-1]:
    SEARCH += [f"{layer}/include", layer]
SEARCH.append("include")
SOURCE = re.compile(r"\.(h|hpp|cuh|c|cc|cpp|cu)$")
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^">]+)[">]')

def tracked_files():
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                             check=True, capture_output=True, text=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        out = [os.path.relpath(os.path.join(d, f)) for d, _, fs in os.walk(".") for f in fs]
    return sorted(f for f in out if SOURCE.search(f) and os.path.isfile(f))

def top(path):
    return path.split("/", 1)[0]

def resolve(includer, kind, name):
    candidates = [os.path.dirname(includer)] if kind == '"' else []
    candidates += SEARCH
    if top(includer) in FREE:  # tests/ and bench/ also see their own root and the source root
        candidates += [top(includer), "."]
    for folder in candidates:
        path = os.path.normpath(os.path.join(folder, name))
        if os.path.isfile(path):
            return path
    return None

def is_public(path):
    parts = path.split("/")
    return len(parts) > 1 and parts[1] == "include" or parts[0] == "include"

problems = []
for f in tracked_files():
    owner = top(f)
    if owner not in RANK and owner not in FREE:
        continue
    with open(f, encoding="utf-8", errors="replace") as text:
        for lineno, line in enumerate(text, 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            target = resolve(f, m.group(1), m.group(2))
            if target is None:
                continue  # a system or third-party header
            where = f"{f}:{lineno}: includes {m.group(2)} -> {target}"
            if owner in FREE:
                if m.group(2).startswith("..") and top(target) != owner:
                    problems.append(f"{where} (relative path out of {owner}/)")
                continue
            layer = top(target)
            if layer not in RANK or layer == owner:
                continue
            if RANK[layer] > RANK[owner]:
                problems.append(f"{where} (upward: {owner} below {layer})")
            elif not is_public(target):
                problems.append(f"{where} (private header of {layer})")

quiet = "-q" in sys.argv[1:]
if not quiet:
    for p in problems:
        print(p)
print(f"check_layers: {len(problems)} violation(s)")
sys.exit(1 if problems else 0)
PY
