"""PyTorch baseline for bench_fused_linear_cross_entropy: plain F.linear + F.cross_entropy.

N=8192 tokens, H=4096, bf16 hidden and weight (both require grad), fp32 loss (logits upcast), labels with
~3% ignore_index, forward + backward. Reports the median time over CUDA events and
torch.cuda.max_memory_allocated beyond the inputs (logits, their fp32 copy, softmax grads, and the
bf16 grads of hidden and weight), same run, same card. Usage: python3 bench/fused_ce_vs_torch.py [--json out]
"""
import argparse
import json

import torch
import torch.nn.functional as F

N, H = 8192, 4096
VOCABS = [32000, 128256, 152064, 250000]
GIB = 1024.0 ** 3


def measure(v, iters=8, warmup=2):
    torch.cuda.empty_cache()
    g = torch.Generator(device="cuda").manual_seed(v)
    x = (torch.rand(N, H, device="cuda", generator=g) * 2 - 1).to(torch.bfloat16).requires_grad_()
    w = ((torch.rand(v, H, device="cuda", generator=g) * 2 - 1) * 0.03).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (N,), device="cuda", generator=g)
    labels[torch.rand(N, device="cuda", generator=g) < 0.03] = -100
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()

    def step():
        x.grad = None
        w.grad = None
        logits = F.linear(x, w)
        loss = F.cross_entropy(logits.float(), labels, ignore_index=-100)
        loss.backward()
        return loss

    for _ in range(warmup):
        step()
    x.grad = None
    w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    peak = torch.cuda.max_memory_allocated() - base
    times.sort()
    ms = times[len(times) // 2]
    flops = 6.0 * N * H * v
    del x, w, labels
    return {"V": v, "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12, "extra_gib": peak / GIB, "loss": float(loss)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--vocab", type=int, action="append", help="only these vocabularies (default: all four)")
    args = ap.parse_args()
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}: plain linear + CE, N={N} H={H} bf16, fwd+bwd")
    rows = []
    for v in args.vocab or VOCABS:
        r = measure(v)
        rows.append(r)
        print(f"V={r['V']:>7}  {r['ms']:8.2f} ms  {r['tflops']:7.1f} TFLOP/s  extra {r['extra_gib']:7.2f} GiB  loss {r['loss']:.4f}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
