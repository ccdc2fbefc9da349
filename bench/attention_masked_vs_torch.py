#!/usr/bin/env python3
"""PyTorch beside bench/cuda/flash_attention_masked.cu (issue 22): the prefix-LM mask and packs of
documents with long-tailed lengths, bf16, 32 heads, forward and forward+backward, TFLOP/s counted over
the visible scores only (the C++ benchmark's count).

PyTorch's anchors, each where it runs (an unavailable one prints why and is left out):
- prefix mask, two documents of T=8192 with a prefix P: flex attention (torch.compile'd, a block mask
  built from the mask function; FlexAttention skips the fully masked blocks like Kestrel), and SDPA's
  cuDNN backend with the dense boolean mask (what a user without flex gets).
- varlen packs (65536 tokens, the C++ side's LCG + Pareto lengths): the FA2 varlen path
  (torch.nn.attention.varlen.varlen_attn, if this torch has it), SDPA's cuDNN backend over nested jagged
  tensors (if it runs), and the padded equivalent (documents padded to the longest, causal; padding at the
  end never reaches a real query under the causal mask), cuDNN backend. The padded FLOPs spent on padding
  are not counted: the number is what a padded run delivers of useful work.

With --kestrel-json FILE (bench_flash_attention_masked --benchmark_format=json output) the Kestrel
column is filled in.
usage: python3 bench/attention_masked_vs_torch.py [--kestrel-json fam.json]
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention_vs_torch import time_ms  # CUDA-event median, the dense table's timing

HEADS, PACK = 32, 65536


def doc_lengths(seed, pack=PACK):
    out, x, used = [], seed, 0
    mask = (1 << 64) - 1
    while used < pack:
        x = (x * 6364136223846793005 + 1442695040888963407) & mask
        u = ((x >> 11) + 0.5) / 9007199254740992.0
        n = int(min(16384.0, math.floor(96.0 / u ** (1.0 / 1.1))))
        n = min(n, pack - used)
        out.append(n)
        used += n
    return out


def tflops(scores, d, bwd, ms):
    return 4.0 * scores * d * HEADS * (3.5 if bwd else 1.0) / (ms * 1e-3) / 1e12


def run(label, fn):
    try:
        return time_ms(fn, reps=10, warmup=3)
    except Exception as err:  # a backend that does not run this shape
        print(f"# {label}: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
        return None


def grad_step(o, inputs, g, bwd):
    if bwd:
        torch.autograd.grad(o, inputs, g)


def prefix_rows(t, d, p, bwd):
    """Two documents of t tokens as batch 2; key j visible to query i iff j <= i or j < p."""
    q, k, v = (torch.randn(2, HEADS, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=bwd) for _ in range(3))
    g = torch.randn(2, HEADS, t, d, device="cuda", dtype=torch.bfloat16)
    scores = 2 * (0.5 * t * t + 0.5 * p * p)
    out = {}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def mask_mod(b, h, qi, kj):
            return (kj <= qi) | (kj < p)
        bm = create_block_mask(mask_mod, None, None, t, t, device="cuda")
        flex = torch.compile(flex_attention)

        def f():
            grad_step(flex(q, k, v, block_mask=bm), (q, k, v), g, bwd)
        ms = run("flex prefix", f)
        out["flex"] = tflops(scores, d, bwd, ms) if ms else None
    except ImportError as err:
        print(f"# flex attention unavailable: {err}")
    i = torch.arange(t, device="cuda")
    dense = (i[None, :] <= i[:, None]) | (i[None, :] < p)

    def c():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            grad_step(F.scaled_dot_product_attention(q, k, v, attn_mask=dense), (q, k, v), g, bwd)
    ms = run("cudnn dense-mask prefix", c)
    out["cudnn_mask"] = tflops(scores, d, bwd, ms) if ms else None
    return out


def varlen_rows(seed, d, bwd):
    lens = doc_lengths(seed)
    scores = sum(0.5 * n * n for n in lens)
    total, mx = sum(lens), max(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.int32)
    q, k, v = (torch.randn(total, HEADS, d, device="cuda", dtype=torch.bfloat16, requires_grad=bwd) for _ in range(3))
    g = torch.randn(total, HEADS, d, device="cuda", dtype=torch.bfloat16)
    out = {"docs": len(lens), "max_len": mx}
    try:
        from torch.nn.attention.varlen import varlen_attn

        import inspect
        # torch 2.9-2.10 take is_causal; 2.11 on express causal as the window (-1, 0) (left unbounded, right 0).
        causal = {"is_causal": True} if "is_causal" in inspect.signature(varlen_attn).parameters \
            else {"window_size": (-1, 0)}

        def fv():
            o = varlen_attn(q, k, v, cu, cu, mx, mx, **causal)
            grad_step(o, (q, k, v), g, bwd)
        ms = run("varlen_attn", fv)
        out["varlen_fa2"] = tflops(scores, d, bwd, ms) if ms else None
    except ImportError as err:
        print(f"# torch.nn.attention.varlen unavailable: {err}")
    # Nested jagged tensors through SDPA (cuDNN backend where it accepts them).
    try:
        offsets = cu.long()  # one offsets tensor: the nested tensors share their ragged dimension

        def nested(x):
            return torch.nested.nested_tensor_from_jagged(x, offsets=offsets).transpose(1, 2)
        qn, kn, vn = nested(q), nested(k), nested(v)
        gn = nested(g)

        def fn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(qn, kn, vn, is_causal=True)
                grad_step(o, (q, k, v), gn, bwd)
        ms = run("cudnn nested", fn)
        out["cudnn_nested"] = tflops(scores, d, bwd, ms) if ms else None
    except Exception as err:
        print(f"# nested jagged tensors: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
    # Padded to the longest document: batch len(lens) x mx; only the documents' own rows are useful work.
    b = len(lens)
    if b * mx > 4 * PACK:
        print(f"# cudnn padded, seed {seed}: {b} documents padded to {mx} = {b * mx} tokens "
              f"({b * mx / PACK:.0f}x the pack), not run")
        return out
    qp, kp, vp = (torch.randn(b, HEADS, mx, d, device="cuda", dtype=torch.bfloat16, requires_grad=bwd) for _ in range(3))
    gp = torch.randn(b, HEADS, mx, d, device="cuda", dtype=torch.bfloat16)

    def fp():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            grad_step(F.scaled_dot_product_attention(qp, kp, vp, is_causal=True), (qp, kp, vp), gp, bwd)
    ms = run("cudnn padded", fp)
    out["cudnn_padded"] = tflops(scores, d, bwd, ms) if ms else None
    return out


def load_kestrel(path):
    """{(benchmark, ((arg, value), ...)): TFLOP/s} from Google Benchmark's JSON output."""
    rows = {}
    if not path:
        return rows
    for bm in json.load(open(path)).get("benchmarks", []):
        if bm.get("run_type") == "aggregate":
            continue
        base, *parts = bm["name"].split("/")
        kv = {a: int(b) for a, b in (p.split(":", 1) for p in parts if ":" in p) if a != "min_time"}
        rows[(base, tuple(sorted(kv.items())))] = bm.get("TFLOPs")
    return rows


def kestrel(rows, base, **args):
    return rows.get((base, tuple(sorted(args.items()))))


def fmt(x):
    return "-" if x is None else f"{x:.0f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kestrel-json", default="")
    ap.add_argument("--prefix-dims", default="128", help="head dims of the prefix rows (flex compiles per shape)")
    args = ap.parse_args()
    kes = load_kestrel(args.kestrel_json)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; TFLOP/s over visible scores")
    print("| mask | D | pass | Kestrel | flex | cuDNN (dense mask) |")
    print("|---|---|---|---|---|---|")
    for bwd in (0, 1):
        for d in (int(x) for x in args.prefix_dims.split(",")):
            for p in (1024, 4096):
                r = prefix_rows(8192, d, p, bool(bwd))
                k = kestrel(kes, "BM_flash_attention_prefix", T=8192, D=d, prefix=p, bwd=bwd)
                print(f"| prefix {p} of 8192 x 2 docs | {d} | {'fwd+bwd' if bwd else 'fwd'} | {fmt(k)} | "
                      f"{fmt(r.get('flex'))} | {fmt(r.get('cudnn_mask'))} |", flush=True)
    print()
    print("| pack (65536 tokens) | docs | max len | D | pass | Kestrel | varlen FA2 | cuDNN nested | cuDNN padded |")
    print("|---|---|---|---|---|---|---|---|---|")
    for bwd in (0, 1):
        for d in (64, 128):
            for seed in (1, 2):
                r = varlen_rows(seed, d, bool(bwd))
                k = kestrel(kes, "BM_flash_attention_varlen", seed=seed, D=d, bwd=bwd)
                print(f"| seed {seed} | {r['docs']} | {r['max_len']} | {d} | {'fwd+bwd' if bwd else 'fwd'} | {fmt(k)} | "
                      f"{fmt(r.get('varlen_fa2'))} | {fmt(r.get('cudnn_nested'))} | {fmt(r.get('cudnn_padded'))} |",
                      flush=True)


if __name__ == "__main__":
    main()
