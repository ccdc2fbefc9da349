#!/usr/bin/env python3
"""PyTorch's training step on the same decoder shapes as a Kestrel config: the same-run anchor (issue 23).

Builds transformers' LlamaForCausalLM from the `model.config` of a Kestrel config (random weights; the
shapes are what matter for speed), and times full training steps on one sequence of `data.seq_len` tokens
(random token ids): forward with labels, backward, gradient clipping at 1.0, fused AdamW (lr 1e-4, wd 0.1).
Modes (one row each):
  amp      f32 parameters and AdamW state, autocast bf16 (what Kestrel's f32-master AdamW computes)
  bf16     bf16 parameters and AdamW state (less memory, no master weights)
each with activation checkpointing per layer ("ckpt", transformers' gradient_checkpointing_enable, non
reentrant) or without ("none"), attention through SDPA (PyTorch picks its flash/cuDNN backend), and with
--compile the model under torch.compile too. The loss is transformers' (full logits in f32): that is the
eager baseline as users run it.

Prints one line per mode: tok/s (median of the timed steps), the step's ms, and torch's peak allocated and
reserved GiB (NVML is not sampled here; bench/train_memory_run.py does that for Kestrel). A mode that runs
out of memory prints OOM and the script goes on.

usage: python3 bench/step_vs_torch.py --config configs/llama_1b5_8k.json [--modes amp:ckpt,amp:none,bf16:ckpt]
          [--steps 8 --warmup 3] [--compile | --compile-only] [--json out.json]
"""
import argparse
import gc
import json
import statistics
import sys
import time


def build(cfg_json, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    mc = dict(cfg_json["model"]["config"])
    mc.pop("model_type", None)
    cfg = LlamaConfig(**mc)
    cfg._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(dtype)
    return model


def run_mode(cfg_json, precision, ckpt, compile_model, steps, warmup, seq_len):
    import torch
    torch.manual_seed(0)
    dtype = torch.float32 if precision == "amp" else torch.bfloat16
    model = build(cfg_json, dtype)
    if ckpt == "ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    fwd = torch.compile(model) if compile_model else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, seq_len), device="cuda")
    times = []
    torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if precision == "amp":
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fwd(input_ids=ids, labels=ids).loss
        else:
            loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    out = {"tok_s": seq_len / (ms / 1e3), "step_ms": ms,
           "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30,
           "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
           "loss": float(loss.detach())}
    del model, fwd, opt, loss
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--modes", default="amp:ckpt,amp:none,bf16:ckpt")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also run each mode under torch.compile")
    ap.add_argument("--compile-only", action="store_true", help="run each mode under torch.compile only")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    import torch
    import transformers
    cfg_json = json.load(open(args.config))
    seq_len = int(cfg_json["data"]["seq_len"])
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}, "
          f"{args.config}, {seq_len} tokens per step", flush=True)
    rows = []
    for mode in args.modes.split(","):
        precision, ckpt = mode.split(":")
        if precision not in ("amp", "bf16") or ckpt not in ("ckpt", "none"):
            sys.exit(f"step_vs_torch: unknown mode '{mode}' (precision amp|bf16, checkpointing ckpt|none)")
        for comp in ([True] if args.compile_only else [False, True] if args.compile else [False]):
            label = f"torch {'compile' if comp else 'eager'} {precision} {ckpt}"
            try:
                r = run_mode(cfg_json, precision, ckpt, comp, args.steps, args.warmup, seq_len)
                r["label"] = label
                print(f"| {label} | {r['tok_s']:.0f} tok/s | {r['step_ms']:.1f} ms | peak alloc "
                      f"{r['peak_alloc_gib']:.1f} GiB (reserved {r['peak_reserved_gib']:.1f}) | loss {r['loss']:.3f} |",
                      flush=True)
            except torch.cuda.OutOfMemoryError:
                r = {"label": label, "oom": True}
                print(f"| {label} | OOM |", flush=True)
                gc.collect()
                torch.cuda.empty_cache()
            rows.append(r)
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
