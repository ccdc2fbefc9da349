#!/usr/bin/env python3
"""Compares Kestrel's loss and every parameter gradient with Hugging Face transformers.

Builds small random models with transformers (Qwen2, Llama, and with sliding-window attention
shorter than the sequence: Mistral, Qwen2 with use_sliding_window/max_window_layers, Qwen3 with
layer_types and q/k norms; eager attention, so the window is transformers' own mask), saves them
(config.json + model.safetensors), writes a token file in the llm.c format, runs
`kestrel-grad` on it, and compares with PyTorch's loss.backward() on the same model:
f32 on the CPU, and bf16 on the GPU (where Kestrel's bf16 error is reported next to
PyTorch's own bf16 error, both against PyTorch in f32). Prints a table; exits non-zero
when a difference exceeds its bound.

usage: tools/compare_hf.py --kestrel-grad build/kestrel-grad [--out DIR] [--devices cpu,cuda]
"""
import argparse
import os
import subprocess
import sys

import numpy as np
import torch
from safetensors.torch import load_file


def write_llmc_tokens(path, tokens):
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, 1, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())


ARCHS = ["qwen2", "llama", "mistral_swa", "qwen2_swa", "qwen3_swa"]


def build(arch, out_dir):
    import transformers as tf
    common = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, rope_theta=10000.0)
    torch.manual_seed(ARCHS.index(arch))
    if arch == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(tie_word_embeddings=True, **common))
    elif arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(tie_word_embeddings=False, **common))
    else:  # sliding windows of 24 tokens (the default sequence is 64)
        if arch == "mistral_swa":
            cfg = tf.MistralConfig(tie_word_embeddings=False, sliding_window=24, **common)
        elif arch == "qwen2_swa":  # layer 0 full, layer 1 sliding
            cfg = tf.Qwen2Config(tie_word_embeddings=True, use_sliding_window=True, sliding_window=24,
                                 max_window_layers=1, **common)
        else:
            cfg = tf.Qwen3Config(tie_word_embeddings=False, head_dim=32, use_sliding_window=True, sliding_window=24,
                                 layer_types=["sliding_attention", "full_attention"], **common)
        cfg._attn_implementation = "eager"
        model = {"mistral_swa": tf.MistralForCausalLM, "qwen2_swa": tf.Qwen2ForCausalLM,
                 "qwen3_swa": tf.Qwen3ForCausalLM}[arch](cfg)
    model = model.float()
    with torch.no_grad():  # move norms and biases off their trivial init so their gradients are generic
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    path = os.path.join(out_dir, arch)
    model.save_pretrained(path, safe_serialization=True)
    return model, path


def torch_grads(model, ids, device, dtype):
    m = model.to(device=device, dtype=dtype)
    m.zero_grad(set_to_none=True)
    x = torch.tensor(ids, device=device)[None]
    out = m(input_ids=x, labels=x)
    out.loss.backward()
    grads = {n: p.grad.detach().double().cpu() for n, p in m.named_parameters()}
    return float(out.loss), grads


def rel(a, b):
    return float((a.double() - b.double()).norm() / max(b.double().norm(), 1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kestrel-grad", required=True)
    ap.add_argument("--out", default="/tmp/kestrel_compare_hf")
    ap.add_argument("--devices", default="cpu,cuda")
    ap.add_argument("--seq-len", type=int, default=64)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, size=args.seq_len + 1)
    tok_path = os.path.join(args.out, "tokens.bin")
    write_llmc_tokens(tok_path, tokens)
    ids = tokens[: args.seq_len].tolist()
    ok = True
    rows = []
    for arch in ARCHS:
        model, path = build(arch, args.out)
        ref_loss, ref = torch_grads(model, ids, "cpu", torch.float32)
        for device in args.devices.split(","):
            if device == "cuda" and not torch.cuda.is_available():
                continue
            dtype = "f32" if device == "cpu" else "bf16"
            out = os.path.join(args.out, f"{arch}_{device}.safetensors")
            subprocess.run([args.kestrel_grad, "--model", path, "--tokens", tok_path, "--seq-len", str(args.seq_len),
                            "--device", device, "--dtype", dtype, "--out", out], check=True)
            k = load_file(out)
            k_loss = float(k["loss"][0])
            worst_k = max(rel(k["grad." + n], g) for n, g in ref.items())
            if dtype == "f32":
                bound = 1e-4
                worst_t = 0.0
                t_loss = ref_loss
            else:
                t_loss, tb = torch_grads(model, ids, device, torch.bfloat16)
                worst_t = max(rel(tb[n], g) for n, g in ref.items())
                bound = max(3 * worst_t, 2e-2)
                model.float().cpu()
            loss_diff = abs(k_loss - ref_loss)
            passed = worst_k <= bound and loss_diff <= (1e-5 if dtype == "f32" else 5e-2)
            ok &= passed
            rows.append((arch, device, dtype, ref_loss, k_loss, loss_diff, worst_k, worst_t, bound, passed))
    print(f"{'model':11} {'device':6} {'dtype':5} {'torch f32 loss':>14} {'kestrel loss':>12} {'|dloss|':>9} "
          f"{'max grad relL2':>14} {'torch bf16 relL2':>16} {'bound':>8} ok")
    for r in rows:
        print(f"{r[0]:11} {r[1]:6} {r[2]:5} {r[3]:14.8f} {r[4]:12.8f} {r[5]:9.2e} {r[6]:14.2e} {r[7]:16.2e} {r[8]:8.1e} {r[9]}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
