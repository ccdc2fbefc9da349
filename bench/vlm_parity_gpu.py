#!/usr/bin/env python3
"""Whole-VLM loss and gradients, Kestrel vs transformers' LlavaForConditionalGeneration (issue 24).

Runs where torch + transformers + safetensors exist (the GPU machine); no network is needed:
  1. transformers builds a random LLaVA (SigLIP vision + Qwen2 text, tied, vision_feature_layer -2,
     strategy "full", erf-GELU projector; the builder of tests/train/fixtures/make_llava_fixture.py at
     larger sizes, or --sizes fixture) and writes it as a folder + one batch of inputs (two sequences,
     three images, labels with -100 at image tokens and over a prompt);
  2. transformers computes the loss and every gradient in f32 (CPU, eager attention: the reference) and
     in bf16 (CUDA: its own bf16 error);
  3. `kestrel-grad --model FOLDER --inputs FILE` computes them in Kestrel: CPU f32 and CUDA bf16.
Prints one row per parameter (relative L2 of the gradient against the f32 reference: Kestrel bf16, transformers
bf16, the bound) and a summary. Passes when
  - Kestrel CPU f32: loss within 1e-5 relative, every gradient within 1e-4 relative L2 (as tools/compare_hf.py);
  - Kestrel CUDA bf16: the loss and every gradient within 2 x transformers-bf16's own error + 4e-3 (bf16's
    rounding floor, the floor of bench/ops_parity_torch.py); gradients the loss does not reach must be zero; a
    vision key bias (zero in exact arithmetic: softmax ignores it) is measured in units of its layer's query-bias
    gradient.
Exit status 1 on any failure.

  python3 bench/vlm_parity_gpu.py --kestrel-grad BIN_DIR/kestrel-grad [--sizes gpu|fixture] [--out DIR]
                                  [--devices cpu,cuda]
"""
import argparse
import importlib.util
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "..", "tests", "train", "fixtures", "make_llava_fixture.py")

GPU_SIZES = dict(
    vision=dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, image_size=64,
                patch_size=8),
    text=dict(vocab_size=1000, hidden_size=256, intermediate_size=704, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024),
    feature_layer=-2)
BF16_FLOOR = 4e-3


def load_generator():
    spec = importlib.util.spec_from_file_location("make_llava_fixture", GEN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rel(a, b, unit=None):
    """||a - b|| / ||b||, or / ||unit|| when given."""
    a, b = a.double(), b.double()
    nb = (unit.double() if unit is not None else b).norm().item()
    if nb == 0.0:
        return 0.0 if (a - b).norm().item() == 0.0 else float("inf")
    return (a - b).norm().item() / nb


def unit_of(name, ref):
    """A vision block's key bias cannot change the loss (softmax ignores q.b, the same for every key, without rotary
    positions): its gradient is 0 in exact arithmetic and rounding noise in every run, so its error is measured
    in units of the same layer's query-bias gradient. None for every other parameter."""
    if "vision_tower." in name and name.endswith("self_attn.k_proj.bias"):
        return ref[name[: -len("k_proj.bias")] + "q_proj.bias"]
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kestrel-grad", required=True, help="the kestrel-grad binary")
    ap.add_argument("--sizes", choices=["gpu", "fixture"], default="gpu")
    ap.add_argument("--out", default="/tmp/kestrel_vlm_parity")
    ap.add_argument("--devices", default="cpu,cuda", help="Kestrel's runs: cpu (f32) and/or cuda (bf16)")
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    import transformers as tf

    gen = load_generator()
    sizes = GPU_SIZES if args.sizes == "gpu" else gen.FIXTURE_SIZES
    os.makedirs(args.out, exist_ok=True)
    folder = os.path.join(args.out, "llava")
    model = gen.build_llava(sizes, seed=args.seed)
    model.train()
    names = gen.write_folder(model, folder)
    ids, pixels, labels = gen.make_inputs(model.config, seed=args.seed + 1)
    inputs = os.path.join(args.out, "inputs.safetensors")
    save_file({"input_ids": ids.contiguous(), "pixel_values": pixels.contiguous(), "labels": labels.contiguous()},
              inputs)
    print(f"transformers {tf.__version__}, torch {torch.__version__}; sizes {args.sizes}: input_ids "
          f"{tuple(ids.shape)}, pixel_values {tuple(pixels.shape)}, {sum(p.numel() for p in model.parameters())} "
          f"parameters in {len(names)} tensors", flush=True)

    ref_loss, ref, no_grad = gen.loss_and_grads(model, ids, pixels, labels)  # f32, CPU
    ref_loss = ref_loss.item()
    print(f"transformers f32 (CPU) loss {ref_loss:.8f}; no gradient: {', '.join(no_grad) or 'none'}", flush=True)
    tb_loss, tb = None, None
    devices = [d for d in args.devices.split(",") if d]
    if "cuda" in devices:
        if not torch.cuda.is_available():
            print("FAIL: --devices includes cuda but torch sees no GPU")
            return 1
        m16 = model.to(device="cuda", dtype=torch.bfloat16)
        tb_loss, tb, _ = gen.loss_and_grads(m16, ids, pixels, labels)
        tb_loss = tb_loss.item()
        print(f"transformers bf16 (CUDA) loss {tb_loss:.8f}", flush=True)

    ok = True
    summary = []
    for device in devices:
        dtype = "f32" if device == "cpu" else "bf16"
        out = os.path.join(args.out, f"kestrel_{device}_{dtype}.safetensors")
        cmd = [args.kestrel_grad, "--model", folder, "--inputs", inputs, "--device", device, "--dtype", dtype,
               "--out", out]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        k = load_file(out)
        k_loss = float(k["loss"][0])
        missing = [n for n in names if "grad." + n not in k]
        if missing:
            print(f"FAIL: Kestrel wrote no gradient for {', '.join(missing)}")
            return 1
        print(f"\n== Kestrel {device} {dtype} vs transformers f32 (relative L2 of each gradient)")
        print(f"{'parameter':64s} {'kestrel':>9s} {'torch bf16':>10s} {'bound':>9s}  ok")
        worst, fails = 0.0, 0
        loss_err = abs(k_loss - ref_loss) / abs(ref_loss)
        if dtype == "f32":
            loss_bound, t_loss_err = 1e-5, float("nan")
        else:
            t_loss_err = abs(tb_loss - ref_loss) / abs(ref_loss)
            loss_bound = 2 * t_loss_err + BF16_FLOOR
        loss_ok = loss_err <= loss_bound
        for n in names:
            unit = unit_of(n, ref)
            ek = rel(k["grad." + n], ref[n], unit)
            if dtype == "f32":
                et, bound = float("nan"), 1e-4
            else:
                et = rel(tb[n], ref[n], unit)
                bound = 2 * et + BF16_FLOOR
            good = ek <= bound and bool(torch.isfinite(k["grad." + n]).all())
            fails += not good
            worst = max(worst, ek)
            print(f"{n:64s} {ek:9.2e} {et:10.2e} {bound:9.2e}  {'yes' if good else 'NO'}"
                  f"{'  (error / ||grad q_proj.bias||: zero in exact arithmetic)' if unit is not None else ''}")
        print(f"{'loss':64s} {loss_err:9.2e} {t_loss_err:10.2e} {loss_bound:9.2e}  {'yes' if loss_ok else 'NO'}"
              f"   (kestrel {k_loss:.8f}, torch f32 {ref_loss:.8f})")
        passed = fails == 0 and loss_ok
        ok &= passed
        summary.append(f"kestrel {device} {dtype}: loss rel err {loss_err:.2e} (bound {loss_bound:.1e}), "
                       f"worst gradient rel L2 {worst:.2e}, {len(names) - fails}/{len(names)} gradients within "
                       f"bounds: {'PASS' if passed else 'FAIL'}")
    print()
    for line in summary:
        print(line)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
