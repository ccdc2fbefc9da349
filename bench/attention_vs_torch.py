#!/usr/bin/env python3
"""PyTorch scaled_dot_product_attention (FLASH_ATTENTION and CUDNN_ATTENTION backends) on the same
shapes as bench/cuda/flash_attention.cu: bf16, 16384 tokens as batch 16384/T, 32 heads, T in
{1k..16k}, D in {64, 72, 128}, causal and bidirectional, forward and forward+backward. FLOPs: forward
4*T*T*D*H*batch (halved when causal), backward 2.5x forward, at the real D (72 is not counted at a
padded width). Then the SigLIP so400m tower's attention (22 images of 729 tokens, 16 heads of 72,
bidirectional; Kestrel's BM_flash_attention_so400m rows, narrow and padded kernels). Timed with CUDA events, median of
repeats, inputs rotated over several sets so L2 does not hold them.

With --kestrel-json FILE (Google Benchmark --benchmark_format=json output of bench_flash_attention)
the Kestrel numbers are printed in the same table; --kestrel NAME=FILE (repeatable) adds one
column per file, e.g. --kestrel before=fa_before.json --kestrel after=fa_after.json for an A/B of
two builds. Only the BM_flash_attention/ rows are read (the window and deterministic benchmarks
have their own arguments).
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

TOKENS, HEADS = 16384, 32


SO400M = dict(t=729, batch=22, heads=16, d=72)


def flops(t, d, causal, bwd, batch=None, heads=HEADS):
    batch = TOKENS // t if batch is None else batch
    f = 4.0 * t * t * d * heads * batch * (0.5 if causal else 1.0)
    return f * (3.5 if bwd else 1.0)


def time_ms(fn, reps=20, warmup=5, warmup_s=0.3):
    """Median of reps event-timed calls, after at least `warmup` calls and `warmup_s` seconds of them:
    the H200 holds 700 W under sustained load and runs faster for about a second after an idle gap, so
    every row is timed at the cap, as bench_flash_attention's --benchmark_min_warmup_time=0.3 rows are
    (bench/RESULTS.md, fourteenth session)."""
    t0 = time.perf_counter()
    n = 0
    while n < warmup or time.perf_counter() - t0 < warmup_s:
        fn()
        n += 1
        if n % 4 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def bench_torch(backend, t, d, causal, bwd, batch=None, heads=HEADS):
    b = TOKENS // t if batch is None else batch
    sets = []
    for _ in range(3):
        q, k, v = (torch.randn(b, heads, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=bwd)
                   for _ in range(3))
        g = torch.randn(b, heads, t, d, device="cuda", dtype=torch.bfloat16)
        sets.append((q, k, v, g))
    i = [0]

    def step():
        q, k, v, g = sets[i[0] % len(sets)]
        i[0] += 1
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            if bwd:
                torch.autograd.grad(o, (q, k, v), g)

    try:
        ms = time_ms(step)
    except RuntimeError as err:  # backend unavailable for this shape
        print(f"# {backend} T={t} D={d}: {str(err).splitlines()[0]}")
        return None
    return flops(t, d, causal, bwd, batch, heads) / (ms * 1e-3) / 1e12


def load_kestrel(path):
    """{(T, D, causal, bwd): TFLOP/s} of the BM_flash_attention rows and {('so400m', bwd, padded): ...}
    of the BM_flash_attention_so400m rows."""
    out = {}
    if not path:
        return out
    with open(path) as f:
        data = json.load(f)
    for bm in data.get("benchmarks", []):
        name = bm["name"]  # BM_flash_attention/T:8192/D:128/causal:1/bwd:1/min_time:.../manual_time
        if bm.get("run_type") == "aggregate":
            continue
        kv = dict(part.split(":", 1) for part in name.split("/")[1:] if ":" in part)
        if name.startswith("BM_flash_attention/"):
            key = (int(kv["T"]), int(kv["D"]), bool(int(kv["causal"])), bool(int(kv["bwd"])))
        elif name.startswith("BM_flash_attention_so400m/"):
            key = ("so400m", bool(int(kv["bwd"])), bool(int(kv["padded"])))
        else:
            continue
        out[key] = bm.get("TFLOPs", 0.0)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kestrel-json", default=None)
    ap.add_argument("--kestrel", action="append", default=[], metavar="NAME=FILE",
                    help="extra kestrel column from a bench_flash_attention JSON file")
    ap.add_argument("--quick", action="store_true", help="only T=8192")
    args = ap.parse_args()
    cols = []
    if args.kestrel_json:
        cols.append(("kestrel", load_kestrel(args.kestrel_json)))
    for spec in args.kestrel:
        name, path = spec.split("=", 1)
        cols.append((f"kestrel {name}", load_kestrel(path)))
    if not cols:
        cols.append(("kestrel", {}))
    ts = [8192] if args.quick else [1024, 2048, 4096, 8192, 16384]
    print(f"# {torch.__version__} {torch.cuda.get_device_name()} bf16, {TOKENS} tokens, {HEADS} heads; TFLOP/s")
    print("| pass | causal | D | T | " + " | ".join(n for n, _ in cols) + " | torch FA2 | torch cuDNN |")
    print("|---|---|---|---|" + "---|" * (len(cols) + 2))
    for bwd in (False, True):
        for causal in (True, False):
            for d in (64, 72, 128):
                for t in ts:
                    fa = bench_torch(SDPBackend.FLASH_ATTENTION, t, d, causal, bwd)
                    cd = bench_torch(SDPBackend.CUDNN_ATTENTION, t, d, causal, bwd)
                    fmt = lambda x: "-" if x is None else f"{x:.0f}"
                    ks = " | ".join(fmt(c.get((t, d, causal, bwd))) for _, c in cols)
                    print(f"| {'fwd+bwd' if bwd else 'fwd'} | {int(causal)} | {d} | {t} | {ks} | {fmt(fa)} | "
                          f"{fmt(cd)} |", flush=True)
    so = SO400M
    print(f"\n# so400m attention: {so['batch']} images x {so['t']} tokens, {so['heads']} heads, D {so['d']}, "
          "bidirectional; TFLOP/s at D 72")
    print("| pass | " + " | ".join(f"{n} | {n} padded" for n, _ in cols) + " | torch FA2 | torch cuDNN |")
    print("|---|" + "---|" * (2 * len(cols) + 2))
    for bwd in (False, True):
        fa, cd = (bench_torch(be, so["t"], so["d"], False, bwd, so["batch"], so["heads"])
                  for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION))
        fmt = lambda x: "-" if x is None else f"{x:.0f}"
        ks = " | ".join(f"{fmt(c.get(('so400m', bwd, False)))} | {fmt(c.get(('so400m', bwd, True)))}" for _, c in cols)
        print(f"| {'fwd+bwd' if bwd else 'fwd'} | {ks} | {fmt(fa)} | {fmt(cd)} |", flush=True)


if __name__ == "__main__":
    main()
