#!/usr/bin/env python3
"""PyTorch eager baselines for the decoder layer's non-GEMM kernels, on the shapes of bench/cuda/ops.cu.

Times each op with CUDA events (median of 20 after warm-up) and prints GB/s against a measured
device copy, in the same table format as bench_ops, so the two can be read side by side in one run:
    python3 bench/ops_vs_torch.py            # table
    python3 bench/ops_vs_torch.py --json f   # also write the figures to f
"""
import argparse
import json

import torch
import torch.nn.functional as F

T, HID, INTER, HEADS, HD = 8192, 4096, 14336, 32, 128
dev = "cuda"
bf16 = torch.bfloat16


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2] / 1e3


def rope_ref(q, pos, theta=500000.0):
    d = q.shape[-1]
    inv = theta ** (-torch.arange(0, d // 2, device=dev, dtype=torch.float64) * 2 / d)
    ang = (pos.double()[:, None] * inv[None, :])
    cos, sin = ang.cos().float().to(q.dtype)[:, None, :], ang.sin().float().to(q.dtype)[:, None, :]
    x1, x2 = q[..., : d // 2], q[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    r = lambda *s, dt=bf16: torch.randn(*s, device=dev, dtype=dt)
    rows = {}

    x = r(T, HID * 4)
    y = torch.empty_like(x)
    copy_s = timed(lambda: y.copy_(x))
    copy_gbs = 2 * x.nbytes / copy_s / 1e9
    rows["copy"] = (copy_s, copy_gbs)

    a, b = r(T, HID * 2), r(T, HID * 2)
    rows["add"] = (s := timed(lambda: a + b), 3 * a.nbytes / s / 1e9)
    af = r(T, HID * 2, dt=torch.float32)
    rows["exp_f32"] = (s := timed(lambda: torch.exp(af)), 2 * af.nbytes / s / 1e9)
    g, u = r(T, INTER), r(T, INTER)
    rows["silu"] = (s := timed(lambda: F.silu(g)), 2 * g.nbytes / s / 1e9)
    rows["swiglu (silu(g)*u, eager)"] = (s := timed(lambda: F.silu(g) * u), 3 * g.nbytes / s / 1e9)
    xn, rn, w, bb = r(2 * T, HID), r(2 * T, HID), r(HID), r(HID)
    rows["rms_norm"] = (s := timed(lambda: F.rms_norm(xn, (HID,), w, 1e-5)), 2 * xn.nbytes / s / 1e9)

    def add_rms():
        h = xn + rn
        return F.rms_norm(h, (HID,), w, 1e-5), h

    rows["add_rms_norm (eager)"] = (s := timed(add_rms), 4 * xn.nbytes / s / 1e9)
    rows["layer_norm"] = (s := timed(lambda: F.layer_norm(xn, (HID,), w, bb, 1e-5)), 2 * xn.nbytes / s / 1e9)
    xg = xn.clone().requires_grad_(True)
    wg = w.clone().requires_grad_(True)
    gy = r(2 * T, HID)

    def rms_fb():
        out = F.rms_norm(xg, (HID,), wg, 1e-5)
        out.backward(gy)

    rows["rms_norm fwd+bwd"] = (s := timed(rms_fb), 5 * xn.nbytes / s / 1e9)
    xs = r(2 * T, 8192)
    rows["softmax"] = (s := timed(lambda: torch.softmax(xs, -1)), 2 * xs.nbytes / s / 1e9)
    q = r(2 * T, HEADS, HD)
    pos = torch.arange(2 * T, device=dev)
    rows["rope (eager rotate-half)"] = (s := timed(lambda: rope_ref(q, pos)), 2 * q.nbytes / s / 1e9)
    xr = r(4 * T, HID, dt=torch.float32)
    rows["sum_rows"] = (s := timed(lambda: xr.sum(0)), xr.nbytes / s / 1e9)

    print(f"{'torch op':34s} {'ms':>8s} {'GB/s':>8s} {'% copy':>7s}")
    for k, (s, gbs) in rows.items():
        print(f"{k:34s} {s * 1e3:8.3f} {gbs:8.0f} {100 * gbs / copy_gbs:6.0f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {"ms": s * 1e3, "GBps": gbs} for k, (s, gbs) in rows.items()}, f, indent=1)


if __name__ == "__main__":
    main()
