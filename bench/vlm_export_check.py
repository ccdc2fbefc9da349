#!/usr/bin/env python3
"""Kestrel's VLM against transformers' LlavaForConditionalGeneration (issue 24).

Runs where torch + transformers + safetensors exist (the GPU machine); no network is needed:
  1. transformers writes tiny random pretrained folders: a SigLIP vision model (SiglipVisionModel,
     or with --full-siglip the two-tower SiglipModel) and a text model (Qwen2ForCausalLM or
     LlamaForCausalLM with --text llama);
  2. a Kestrel run config takes its towers from them (model.vision_from / model.text_from) with
     LLaVA's architecture (pixel_shuffle_factor 1, projector_hidden_act "gelu", vision_feature_layer);
  3. `kestrel-train export --format llava` writes the VLM (fresh projector included) as a LLaVA folder
     and, from a fixed input (random pixels, image tokens then random text ids), Kestrel's logits (CPU, f32);
  4. transformers loads the folder and computes the same input's logits (f32, eager attention).
Prints the largest absolute and the relative L2 difference of the logits and the greedy-token
agreement; exits 1 when the relative L2 difference exceeds --tol (default 1e-4) or the export does
not load.

  python3 bench/vlm_export_check.py --bin build-cpu/kestrel-train [--text qwen2|llama] [--full-siglip]
                                    [--feature-layer -2] [--device cpu|cuda] [--keep DIR]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file


def write_towers(root, text, full_siglip, seed):
    import transformers as tf

    torch.manual_seed(seed)
    vcfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                image_size=32, patch_size=8, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
    vision_dir = os.path.join(root, "siglip")
    if full_siglip:
        cfg = tf.SiglipConfig(vision_config=vcfg, text_config=dict(hidden_size=32, intermediate_size=64,
                                                                   num_hidden_layers=1, num_attention_heads=2,
                                                                   vocab_size=100))
        tf.SiglipModel(cfg).save_pretrained(vision_dir)
    else:
        tf.SiglipVisionModel(tf.SiglipVisionConfig(**vcfg)).save_pretrained(vision_dir)
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=(text == "qwen2"), rms_norm_eps=1e-6)
    text_dir = os.path.join(root, text)
    if text == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    else:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    # Non-trivial norms and biases, so a swapped name or a missing bias shows in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(text_dir)
    return vision_dir, text_dir


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build-cpu/kestrel-train", help="the kestrel-train binary")
    ap.add_argument("--text", choices=["qwen2", "llama"], default="qwen2")
    ap.add_argument("--full-siglip", action="store_true", help="the vision half of a two-tower SigLIP folder")
    ap.add_argument("--feature-layer", type=int, default=-2, help="vision_feature_layer (LLaVA-1.5: -2)")
    ap.add_argument("--device", default="cpu", help="where transformers runs (f32)")
    ap.add_argument("--tol", type=float, default=1e-4, help="largest relative L2 difference accepted")
    ap.add_argument("--keep", default="", help="work folder to keep (default: a temporary one)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import transformers as tf

    root = args.keep or tempfile.mkdtemp(prefix="kestrel_llava_")
    os.makedirs(root, exist_ok=True)
    vision_dir, text_dir = write_towers(root, args.text, args.full_siglip, args.seed)
    image_token = 299
    run = {
        "model": {"type": "vlm", "vision_from": vision_dir, "text_from": text_dir,
                  "config": {"model_type": "kestrel_vlm", "image_token_id": image_token, "pixel_shuffle_factor": 1,
                             "projector_hidden_act": "gelu", "vision_feature_layer": args.feature_layer}},
        "data": {"image_size": 32},
        "device": "cpu",
        "out_dir": os.path.join(root, "run"),
    }
    cfg_path = os.path.join(root, "run.json")
    with open(cfg_path, "w") as f:
        json.dump(run, f, indent=2)

    # The fixed input: one image (16 patches = 16 image tokens) then 24 text ids.
    g = torch.Generator().manual_seed(args.seed + 1)
    n_img = (32 // 8) ** 2
    ids = torch.cat([torch.full((n_img,), image_token, dtype=torch.int64),
                     torch.randint(0, 299, (24,), generator=g, dtype=torch.int64)])
    pixels = torch.rand((1, 3, 32, 32), generator=g) * 2 - 1
    probe_in, probe_out = os.path.join(root, "probe_in.safetensors"), os.path.join(root, "probe_out.safetensors")
    save_file({"input_ids": ids, "pixel_values": pixels}, probe_in)
    export_dir = os.path.join(root, "llava")
    cmd = [args.bin, "export", "--config", cfg_path, "--format", "llava", "--out", export_dir,
           "--logits-in", probe_in, "--logits-out", probe_out]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    ours = load_file(probe_out)["logits"].double()

    try:
        model = tf.LlavaForConditionalGeneration.from_pretrained(export_dir, torch_dtype=torch.float32,
                                                                 attn_implementation="eager")
    except Exception as e:  # the export must load
        print(f"FAIL: transformers {tf.__version__} cannot load the export: {e}")
        return 1
    model = model.to(args.device).eval()
    with torch.no_grad():
        out = model(input_ids=ids[None].to(args.device), pixel_values=pixels.to(args.device))
    theirs = out.logits[0].double().cpu()
    if theirs.shape != ours.shape:
        print(f"FAIL: logits shape {tuple(ours.shape)} (Kestrel) vs {tuple(theirs.shape)} (transformers)")
        return 1
    diff = (ours - theirs)
    rel = (diff.norm() / theirs.norm()).item()
    agree = (ours.argmax(-1) == theirs.argmax(-1)).double().mean().item()
    print(f"transformers {tf.__version__}, torch {torch.__version__}, text {args.text}, "
          f"{'full siglip' if args.full_siglip else 'siglip_vision_model'}, vision_feature_layer {args.feature_layer}")
    print(f"logits {tuple(ours.shape)}: max |diff| {diff.abs().max().item():.3e}, relative L2 {rel:.3e}, "
          f"greedy tokens agree {100 * agree:.1f}%")
    ok = rel <= args.tol
    print("PASS" if ok else f"FAIL: relative L2 {rel:.3e} > {args.tol:.1e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
