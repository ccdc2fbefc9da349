#!/usr/bin/env python3
"""PyTorch eager baselines for the decoder layer's non-GEMM kernels, on the shapes of bench/cuda/ops.cu.

Times each op with CUDA events (median of 20 after warm-up) and prints GB/s against a measured
device copy, in the same table format as bench_ops, so the two can be read side by side in one run:
    python3 bench/ops_vs_torch.py            # table
    python3 bench/ops_vs_torch.py --json f   # also write the figures to f
    python3 bench/ops_vs_torch.py --kestrel bench_ops.json
        # side-by-side table with bench_ops's --benchmark_out=bench_ops.json (same run, same card)
    python3 bench/ops_vs_torch.py --kestrel bench_ops.json --torch-json f   # re-print it later
"""
import argparse
import json

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # --torch-json re-prints without PyTorch
    torch = F = None

T, HID, INTER, HEADS, HD = 8192, 4096, 14336, 32, 128
dev = "cuda"
bf16 = torch.bfloat16 if torch else None


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
    ap.add_argument("--kestrel", default=None, help="bench_ops --benchmark_out JSON for a side-by-side table")
    ap.add_argument("--torch-json", default=None, help="with --kestrel: take PyTorch's figures from this --json file")
    args = ap.parse_args()
    if args.torch_json:  # re-print a side-by-side table from an earlier run's files, no GPU needed
        with open(args.torch_json) as f:
            rows = {k: (v["ms"] / 1e3, v["GBps"]) for k, v in json.load(f).items()}
        side_by_side(args.kestrel, rows, rows["copy"][1])
        return
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

    def rms_fb():  # gradients reset: no leaf accumulation (an activation's gradient in training)
        xg.grad = wg.grad = None
        out = F.rms_norm(xg, (HID,), wg, 1e-5)
        out.backward(gy)

    rows["rms_norm fwd+bwd"] = (s := timed(rms_fb), 5 * xn.nbytes / s / 1e9)
    out_r = F.rms_norm(xg, (HID,), wg, 1e-5)
    rows["rms_norm bwd"] = (s := timed(lambda: torch.autograd.grad(out_r, [xg, wg], gy, retain_graph=True)),
                            3 * xn.nbytes / s / 1e9)
    bg = bb.clone().requires_grad_(True)

    def ln_fb():
        xg.grad = wg.grad = bg.grad = None
        F.layer_norm(xg, (HID,), wg, bg, 1e-5).backward(gy)

    rows["layer_norm fwd+bwd"] = (s := timed(ln_fb), 5 * xn.nbytes / s / 1e9)
    out_l = F.layer_norm(xg, (HID,), wg, bg, 1e-5)
    rows["layer_norm bwd"] = (s := timed(lambda: torch.autograd.grad(out_l, [xg, wg, bg], gy, retain_graph=True)),
                              3 * xn.nbytes / s / 1e9)
    xs = r(2 * T, 8192)
    rows["softmax"] = (s := timed(lambda: torch.softmax(xs, -1)), 2 * xs.nbytes / s / 1e9)
    xsg, gs = xs.clone().requires_grad_(True), r(2 * T, 8192)
    def sm_fb():
        xsg.grad = None
        torch.softmax(xsg, -1).backward(gs)

    rows["softmax fwd+bwd"] = (s := timed(sm_fb), 5 * xs.nbytes / s / 1e9)
    out_s = torch.softmax(xsg, -1)
    rows["softmax bwd"] = (s := timed(lambda: torch.autograd.grad(out_s, [xsg], gs, retain_graph=True)),
                           3 * xs.nbytes / s / 1e9)
    q = r(2 * T, HEADS, HD)
    pos = torch.arange(2 * T, device=dev)
    rows["rope (eager rotate-half)"] = (s := timed(lambda: rope_ref(q, pos)), 2 * q.nbytes / s / 1e9)
    xr = r(4 * T, HID, dt=torch.float32)
    rows["sum_rows"] = (s := timed(lambda: xr.sum(0)), xr.nbytes / s / 1e9)
    acc_a, acc_b = r(2 * T, HID), r(2 * T, HID)
    rows["grad += (add_)"] = (s := timed(lambda: acc_a.add_(acc_b)), 3 * acc_a.nbytes / s / 1e9)
    xb = r(8 * T, HID)
    rows["sum_rows bf16"] = (s := timed(lambda: xb.sum(0)), xb.nbytes / s / 1e9)
    params = [torch.nn.Parameter(torch.empty(T, HID, device=dev, dtype=bf16)) for _ in range(8)]
    for p in params:
        p.grad = r(T, HID)
    rows["clip_grad_norm_ (8 x 64 MiB)"] = (s := timed(lambda: torch.nn.utils.clip_grad_norm_(params, 1e-3)),
                                           3 * 8 * params[0].grad.nbytes / s / 1e9)

    print(f"{'torch op':34s} {'ms':>8s} {'GB/s':>8s} {'% copy':>7s}")
    for k, (s, gbs) in rows.items():
        print(f"{k:34s} {s * 1e3:8.3f} {gbs:8.0f} {100 * gbs / copy_gbs:6.0f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {"ms": s * 1e3, "GBps": gbs} for k, (s, gbs) in rows.items()}, f, indent=1)
    if args.kestrel:
        side_by_side(args.kestrel, rows, copy_gbs)


# bench_ops benchmark -> (shape, torch row or None)
PAIRS = [
    ("BM_copy", "bf16 8192x16384", "copy"),
    ("BM_add", "bf16 8192x8192", "add"),
    ("BM_exp_f32", "f32 8192x8192", "exp_f32"),
    ("BM_silu", "bf16 8192x14336", "silu"),
    ("BM_swiglu", "bf16 8192x14336", "swiglu (silu(g)*u, eager)"),
    ("BM_rms_norm", "bf16 16384x4096", "rms_norm"),
    ("BM_add_rms_norm", "bf16 16384x4096", "add_rms_norm (eager)"),
    ("BM_layer_norm", "bf16 16384x4096", "layer_norm"),
    ("BM_rms_norm_backward", "bf16 16384x4096 fwd+bwd", "rms_norm fwd+bwd"),
    ("BM_rms_norm_bwd_kernel", "bf16 16384x4096 bwd", "rms_norm bwd"),
    ("BM_layer_norm_fwd_bwd", "bf16 16384x4096 fwd+bwd", "layer_norm fwd+bwd"),
    ("BM_layer_norm_bwd_kernel", "bf16 16384x4096 bwd", "layer_norm bwd"),
    ("BM_softmax", "bf16 16384x8192", "softmax"),
    ("BM_softmax_fwd_bwd", "bf16 16384x8192 fwd+bwd", "softmax fwd+bwd"),
    ("BM_softmax_bwd_kernel", "bf16 16384x8192 bwd", "softmax bwd"),
    ("BM_rope", "bf16 16384x32x128", "rope (eager rotate-half)"),
    ("BM_sum_rows", "f32 32768x4096 -> 4096", "sum_rows"),
    ("BM_sum_rows_bf16", "bf16 65536x4096 -> 4096", "sum_rows bf16"),
    ("BM_clip_grad_norm_device", "8 x bf16 8192x4096", "clip_grad_norm_ (8 x 64 MiB)"),
    ("BM_add_into_bf16", "bf16 16384x4096 (runtime)", "grad += (add_)"),
]


def side_by_side(path, rows, torch_copy_gbs):
    with open(path) as f:  # names like BM_rms_norm/min_time:0.050/manual_time -> BM_rms_norm
        bench = {b["name"].replace("/min_time:0.050", "").replace("/manual_time", ""): b
                 for b in json.load(f)["benchmarks"] if b.get("run_type", "iteration") == "iteration"}
    copy = bench.get("BM_copy", {}).get("GB/s", 0)
    print(f"\nKestrel vs PyTorch eager (copy: Kestrel {copy:.0f} GB/s, torch {torch_copy_gbs:.0f} GB/s)")
    print(f"{'op':26s} {'shape':26s} {'k ms':>7s} {'k GB/s':>7s} {'%copy':>6s} {'torch ms':>8s} {'k/t':>5s}")
    for name, shape, trow in PAIRS:
        b = bench.get(name)
        if b is None:
            continue
        ms = b["real_time"] if b.get("time_unit", "ms") == "ms" else b["real_time"] / 1e6
        gbs = b.get("GB/s", 0)
        t = rows.get(trow)
        tms = f"{t[0] * 1e3:8.3f}" if t else f"{'-':>8s}"
        ratio = f"{ms / (t[0] * 1e3):5.2f}" if t else f"{'-':>5s}"
        print(f"{name[3:]:26s} {shape:26s} {ms:7.3f} {gbs:7.0f} {100 * gbs / copy if copy else 0:5.0f}% {tms} {ratio}")
    for name, b in bench.items():
        if "matmul" in name or "gemmex" in name:
            print(f"{name:40s} {b.get('TFLOP/s', 0):7.1f} TFLOP/s")


if __name__ == "__main__":
    main()
