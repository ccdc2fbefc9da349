#!/usr/bin/env python3
"""Decoder-sized ops, Kestrel vs PyTorch on the same inputs (the dump of tests/ops/cuda/test_torch_parity_dump.cpp).

    KESTREL_TORCH_PARITY_OUT=/tmp/p.safetensors test_ops_cuda --gtest_filter='CudaTorchParity.*'
    python3 bench/ops_parity_torch.py /tmp/p.safetensors

For every output: the relative L2 error of Kestrel's result against an f32 (f64 for AdamW and the
column sums) reference recomputed by PyTorch from the dumped inputs, next to PyTorch's own error when
it computes in the storage dtype (bf16). An output passes when Kestrel's error is at most twice
PyTorch's own error, or below a floor tied to the output dtype (bf16 rounding: 4e-3; f32: 1e-6).
Flash attention (out, dq, dk, dv of each "attn_*" case) follows FlashAttention's own test rule: the
largest absolute error against a float64 reference (per document, GQA, causal / sliding window /
bidirectional masks) at most twice that of PyTorch's scaled_dot_product_attention in bf16 on the same
inputs, plus an atol of twice the f32 rounding at the reference's scale; lse against the float64
log-sum-exp within 1e-4 relative. Exit status 1 when any output fails.
"""
import sys

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

FLOOR = {torch.bfloat16: 4e-3, torch.float16: 1e-3, torch.float32: 1e-6}


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class Table:
    def __init__(self):
        self.rows, self.failed = [], 0

    def check(self, name, kestrel, ref, torch_own=None):
        ek = rel(kestrel, ref)
        et = rel(torch_own, ref) if torch_own is not None else float("nan")
        bound = max(2 * et if torch_own is not None else 0.0, FLOOR[kestrel.dtype])
        ok = ek <= bound and torch.isfinite(kestrel.float()).all().item()
        self.failed += not ok
        self.rows.append((name, "x".join(map(str, kestrel.shape)), str(kestrel.dtype).replace("torch.", ""), ek, et,
                          bound, ok))

    def check_max_abs(self, name, kestrel, ref, torch_own):
        """FlashAttention's rule: max |kestrel - ref| <= 2 max |torch_own - ref| + 2 * f32 rounding at ref's scale."""
        ref = ref.double()
        ek = (kestrel.double() - ref).abs().max().item()
        et = (torch_own.double() - ref).abs().max().item()
        r32 = ref.float()
        atol = 2 * (r32 + 0.3 - 0.3 - r32).abs().max().item()
        bound = 2 * et + atol
        ok = ek <= bound and torch.isfinite(kestrel.float()).all().item()
        self.failed += not ok
        self.rows.append((name + " (max abs)", "x".join(map(str, kestrel.shape)), str(kestrel.dtype).replace("torch.", ""),
                          ek, et, bound, ok))

    def print(self):
        print(f"{'output':22s} {'shape':18s} {'dtype':8s} {'kestrel rel':>11s} {'torch rel':>10s} {'bound':>9s}  ok")
        for n, s, d, ek, et, b, ok in self.rows:
            print(f"{n:22s} {s:18s} {d:8s} {ek:11.2e} {et:10.2e} {b:9.2e}  {'yes' if ok else 'NO'}")
        print(f"{len(self.rows) - self.failed}/{len(self.rows)} outputs within bounds")


def grads(fn, inputs, dy):
    """Output and input gradients of fn(*inputs) for upstream dy."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(dy)
    return [out.detach()] + [t.grad for t in leaves]


def rope_ref(q, pos, theta):
    d = q.shape[-1]
    inv = theta ** (-torch.arange(0, d // 2, device=q.device, dtype=torch.float64) * 2 / d)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = ang.cos().to(q.dtype)[:, None, :], ang.sin().to(q.dtype)[:, None, :]
    x1, x2 = q[..., : d // 2], q[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention_documents(q, k, lens, causal, window):
    """Per packed document of [T, H, D] q / k: its start, length, query heads [Hq, n, D], K heads repeated
    to Hq (GQA) and the [n, n] visibility (causal, sliding window: key j seen by query i iff
    i - window < j <= i)."""
    start, group = 0, q.shape[1] // k.shape[1]
    for n in lens:
        i = torch.arange(n, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        visible = torch.ones(n, n, dtype=torch.bool, device=q.device)
        if causal:
            visible &= j <= i
        if window > 0:
            visible &= j > i - window
        qh = q[start:start + n].transpose(0, 1)
        kh = k[start:start + n].transpose(0, 1).repeat_interleave(group, 0)
        yield start, n, qh, kh, visible
        start += n


def attention_docs(q, k, v, lens, causal, window, scale, sdpa):
    """Attention over packed documents ([T, H, D] tensors).
    sdpa=False: explicit softmax(Q K^T * scale + mask) V in the inputs' dtype (the float64 reference);
    sdpa=True: torch's scaled_dot_product_attention (PyTorch's own fused bf16 path)."""
    outs, group = [], q.shape[1] // k.shape[1]
    for start, n, qh, kh, visible in attention_documents(q, k, lens, causal, window):
        vh = v[start:start + n].transpose(0, 1).repeat_interleave(group, 0)
        if sdpa:
            if window <= 0:  # causal or full: the fused kernels' own masking
                o = F.scaled_dot_product_attention(qh[None], kh[None], vh[None], is_causal=causal, scale=scale)[0]
            else:
                o = F.scaled_dot_product_attention(qh[None], kh[None], vh[None], attn_mask=visible, scale=scale)[0]
        else:
            sc = (qh @ kh.transpose(1, 2)) * scale
            o = torch.softmax(sc.masked_fill(~visible, float("-inf")), -1) @ vh
        outs.append(o.transpose(0, 1))
    return torch.cat(outs, 0)


def attention_lse(q, k, lens, causal, window, scale):
    """Natural-log log-sum-exp of the visible scaled scores, float64, [T, Hq]."""
    rows = []
    for _, _, qh, kh, visible in attention_documents(q.double(), k.double(), lens, causal, window):
        sc = ((qh @ kh.transpose(1, 2)) * scale).masked_fill(~visible, float("-inf"))
        rows.append(torch.logsumexp(sc, -1).transpose(0, 1))
    return torch.cat(rows, 0)


def main():
    path = sys.argv[1]
    t = load_file(path, device="cuda")
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    eps = float(meta["eps"])
    tab = Table()
    f32 = lambda *xs: [x.float() for x in xs]

    x, w, dy = t["rms_norm.x"], t["rms_norm.w"], t["rms_norm.dy"]
    rms = lambda a, b: F.rms_norm(a, (a.shape[-1],), b, eps)
    ref, own = grads(rms, f32(x, w), dy.float()), grads(rms, [x, w], dy)
    for i, n in enumerate(["y", "dx", "dw"]):
        tab.check("rms_norm." + n, t["rms_norm." + n], ref[i], own[i])

    x, w, b, dy = t["layer_norm.x"], t["layer_norm.w"], t["layer_norm.b"], t["layer_norm.dy"]
    ln = lambda a, c, d: F.layer_norm(a, (a.shape[-1],), c, d, eps)
    ref, own = grads(ln, f32(x, w, b), dy.float()), grads(ln, [x, w, b], dy)
    for i, n in enumerate(["y", "dx", "dw", "db"]):
        tab.check("layer_norm." + n, t["layer_norm." + n], ref[i], own[i])

    x, dy = t["softmax.x"], t["softmax.dy"]
    sm = lambda a: torch.softmax(a, -1)
    ref, own = grads(sm, f32(x), dy.float()), grads(sm, [x], dy)
    for i, n in enumerate(["y", "dx"]):
        tab.check("softmax." + n, t["softmax." + n], ref[i], own[i])

    g, u, dy = t["swiglu.g"], t["swiglu.u"], t["swiglu.dy"]
    sw = lambda a, c: F.silu(a) * c
    ref, own = grads(sw, f32(g, u), dy.float()), grads(sw, [g, u], dy)
    for i, n in enumerate(["y", "dg", "du"]):
        tab.check("swiglu." + n, t["swiglu." + n], ref[i], own[i])

    q, pos, theta = t["rope.q"], t["rope.pos"], float(meta["rope_theta"])
    tab.check("rope.y", t["rope.y"], rope_ref(q.float(), pos, theta), rope_ref(q, pos, theta))

    ids, dy, dw = t["embedding.ids"], t["embedding.dy"], t["embedding.dw"]
    ref = torch.zeros(dw.shape, device="cuda", dtype=torch.float32).index_add_(0, ids, dy.float())
    wb = torch.zeros(dw.shape, device="cuda", dtype=dw.dtype, requires_grad=True)
    F.embedding(ids, wb).backward(dy)
    tab.check("embedding.dw", dw, ref, wb.grad)

    lr, b1, b2 = float(meta["adamw_lr"]), float(meta["adamw_beta1"]), float(meta["adamw_beta2"])
    aeps, wd, step = float(meta["adamw_eps"]), float(meta["adamw_wd"]), int(meta["adamw_step"])
    p, gr, m, v = (t["adamw." + n].double() for n in ["p", "g", "m", "v"])
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * gr
    v = b2 * v + (1 - b2) * gr * gr
    p = p - lr / (1 - b1 ** step) * m / (v.sqrt() / (1 - b2 ** step) ** 0.5 + aeps)
    po, mo, vo = (t["adamw." + n].clone() for n in ["p", "m", "v"])  # torch's own f32 step, same state
    pt = torch.nn.Parameter(po)
    pt.grad = t["adamw.g"].float()
    opt = torch.optim.AdamW([pt], lr=lr, betas=(b1, b2), eps=aeps, weight_decay=wd, foreach=False)
    opt.state[pt] = {"step": torch.tensor(float(step - 1)), "exp_avg": mo, "exp_avg_sq": vo}
    opt.step()
    tab.check("adamw.p", t["adamw.p_out"], p, pt.detach())
    tab.check("adamw.m", t["adamw.m_out"], m, opt.state[pt]["exp_avg"])
    tab.check("adamw.v", t["adamw.v_out"], v, opt.state[pt]["exp_avg_sq"])
    tab.check("adamw.copy", t["adamw.copy"], p, pt.detach().to(torch.bfloat16))

    for n in ["colsum_bf16", "colsum_f32"]:
        xs = t[n + ".x"]
        tab.check(n + ".y", t[n + ".y"], xs.double().sum(0), xs.sum(0))

    for name in sorted({key.split(".")[0] for key in t if key.startswith("attn_")}):
        q, k, v, dout = (t[f"{name}.{n}"] for n in ["q", "k", "v", "dout"])
        lens = [int(x) for x in meta[name + ".lens"].split(",")]
        causal, window = meta[name + ".causal"] == "1", int(meta[name + ".window"])
        scale = q.shape[-1] ** -0.5
        fn = lambda sdpa: (lambda a, b, c: attention_docs(a, b, c, lens, causal, window, scale, sdpa))
        ref = grads(fn(False), [q.double(), k.double(), v.double()], dout.double())
        own = grads(fn(True), [q, k, v], dout)
        for i, n in enumerate(["out", "dq", "dk", "dv"]):
            tab.check_max_abs(f"{name}.{n}", t[f"{name}.{n}"], ref[i], own[i])
            tab.check(f"{name}.{n}", t[f"{name}.{n}"], ref[i], own[i])
        lse_ref = attention_lse(q, k, lens, causal, window, scale)
        lse_err = ((t[name + ".lse"].double() - lse_ref).abs() / (1 + lse_ref.abs())).max().item()
        tab.failed += not lse_err <= 1e-4
        tab.rows.append((name + ".lse (max rel)", "x".join(map(str, lse_ref.shape)), "float32", lse_err, float("nan"),
                         1e-4, lse_err <= 1e-4))

    tab.print()
    sys.exit(1 if tab.failed else 0)


if __name__ == "__main__":
    main()
