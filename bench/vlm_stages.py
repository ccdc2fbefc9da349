#!/usr/bin/env python3
"""Stage 1 then stage 2 on the shapes data from saved towers, against training from scratch (issue 24).

Needs only a kestrel-train binary and Python 3 (no torch): safetensors files are read and written here.
  (a) pretrained towers: the quickstart VLM (configs/quickstart_vlm.json, its on_cpu / on_cuda sizes applied)
      trained on ANOTHER shapes variant (data.seed 11, shape_scale 1.0, noise 12; the target is seed 7,
      shape_scale 1.5, noise 8), its final checkpoint split into a SigLIP vision folder ("vision_model.*") and a
      Qwen2 folder ("model.*"), each with its config.json: what model.vision_from / model.text_from load;
  (b) stage 1: the quickstart architecture with the towers from those folders and a fresh projector,
      train.trainable ["multi_modal_projector.*"], on the target data; checked from the files: every tower
      tensor of stage 1's final checkpoint is bitwise the folders' tensor, and every projector tensor differs
      from its initial value (the untrained model exported by `kestrel-train export`);
  (c) stage 2: everything trainable from stage 1's result (exported as a Kestrel folder: config_path + init_from),
      the quickstart's optimiser settings and step count;
  (d) from scratch: the quickstart config itself, same steps.
Both (c) and (d) evaluate the held-out captions every --eval-every steps; reported: the first step at which the
caption accuracy (greedy captions exactly right, the quickstart's measure) reaches --target (default 0.9, the
quickstart's bar in tools/quickstart.sh), for stage 2 and from scratch, and stage 1's steps on top.
Writes OUT/vlm_stages.json and OUT/vlm_stages.md (one markdown table row); exits 1 when a check fails (the
step comparison is reported, not required). Also reported: the steps to 50%.
Measured on the dev machine (CPU, 2 shared cores; --pretrain-steps 400 --stage1-steps 50 --steps 400
--eval-every 50 --eval-samples 50, ~15 min): the towers bitwise unchanged by stage 1; held-out captions at steps
50..400: stage 2 22 32 36 38 34 64 58 62%, scratch 0 2 4 8 16 28 42 24% (neither reaches 90% in 400 steps).

  python3 bench/vlm_stages.py --bin build/kestrel-train --device cpu --smoke      # minutes on 2 cores
  python3 bench/vlm_stages.py --bin .carry/kestrel-train --device cuda            # the full run
"""
import argparse
import copy
import json
import os
import math
import re
import shutil
import struct
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PRETRAIN_DATA = {"seed": 11, "shape_scale": 1.0, "noise": 12}


# ---- safetensors without torch ----
def st_read(path):
    """{name: (dtype, shape, bytes)} and the metadata of one .safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in header.items()}, meta


def st_floats(entry):
    """The values of an F32 / BF16 tensor as Python floats."""
    dtype, _, raw = entry
    if dtype == "F32":
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    if dtype == "BF16":
        halves = struct.unpack(f"<{len(raw) // 2}H", raw)
        return list(struct.unpack(f"<{len(halves)}f", struct.pack(f"<{len(halves)}I", *(h << 16 for h in halves))))
    raise SystemExit(f"FAIL: unexpected dtype {dtype}")


def rel_change(after, before):
    a, b = st_floats(after), st_floats(before)
    d = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))
    n = math.sqrt(sum(y * y for y in b))
    return d / n if n > 0 else (math.inf if d > 0 else 0.0)


def st_write(path, tensors):
    header, blobs, off = {}, [], 0
    for k in sorted(tensors):
        dtype, shape, raw = tensors[k]
        header[k] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


# ---- configs and runs ----
def set_path(cfg, dotted, value):
    keys = dotted.split(".")
    d = cfg
    for k in keys[:-1]:
        d = d.setdefault(k, {})
    d[keys[-1]] = value


def quickstart(device):
    """configs/quickstart_vlm.json with its on_<device> sizes applied (so every run here has explicit shapes)."""
    with open(os.path.join(ROOT, "configs", "quickstart_vlm.json")) as f:
        cfg = json.load(f)
    for k, v in cfg.pop("on_" + device, {}).items():
        set_path(cfg, k, v)
    cfg.pop("on_cpu", None)
    cfg.pop("on_cuda", None)
    cfg["device"] = device
    return cfg


def run(binary, cfg, out_dir, log_name):
    shutil.rmtree(out_dir, ignore_errors=True)  # this script's own folder: a fresh run each time
    os.makedirs(out_dir)
    path = os.path.join(out_dir, log_name + ".json")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    cmd = [binary, "--config", path]
    print("+", " ".join(cmd), flush=True)
    t0 = time.time()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with open(os.path.join(out_dir, log_name + ".log"), "w") as f:
        f.write(p.stdout)
    if p.returncode != 0:
        sys.stdout.write(p.stdout[-4000:])
        raise SystemExit(f"FAIL: {' '.join(cmd)} exited {p.returncode}")
    return p.stdout, time.time() - t0


def export(binary, cfg_path_dir, cfg, out, weights=None):
    shutil.rmtree(out, ignore_errors=True)
    path = os.path.join(cfg_path_dir, "export_" + os.path.basename(out) + ".json")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    cmd = [binary, "export", "--config", path, "--format", "kestrel", "--out", out]
    if weights:
        cmd += ["--weights", weights]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def last_checkpoint(out_dir):
    root = os.path.join(out_dir, "checkpoints")
    steps = sorted(d for d in os.listdir(root) if re.fullmatch(r"step_\d{8}", d)) if os.path.isdir(root) else []
    if not steps:
        raise SystemExit(f"FAIL: no checkpoint in {root}")
    return os.path.join(root, steps[-1])


def accuracy_curve(log, final_step):
    """[(step, caption accuracy)] from 'eval @ N: caption accuracy X%' lines and the final 'held-out captions'."""
    curve = [(int(m.group(1)), float(m.group(2)) / 100)
             for m in re.finditer(r"eval @ (\d+): caption accuracy ([\d.]+)%", log)]
    m = re.search(r"held-out captions: ([\d.]+)% exactly right", log)
    if m:
        curve.append((final_step, float(m.group(1)) / 100))
    return curve


def first_reaching(curve, target):
    return next((s for s, a in curve if a >= target), None)


def split_towers(ckpt, vlm_cfg, out):
    """A Kestrel VLM checkpoint -> a SigLIP vision folder and a text-model folder (HF names and configs)."""
    tensors, _ = st_read(os.path.join(ckpt, "model.safetensors"))
    vision = {k[len("vision_tower."):]: v for k, v in tensors.items() if k.startswith("vision_tower.")}
    text = {k[len("language_model."):]: v for k, v in tensors.items() if k.startswith("language_model.")}
    dirs = {}
    for name, part, conf in (("siglip", vision, vlm_cfg["vision_config"]), ("text", text, vlm_cfg["text_config"])):
        d = os.path.join(out, name)
        os.makedirs(d, exist_ok=True)
        st_write(os.path.join(d, "model.safetensors"), part)
        conf = dict(conf)
        conf.setdefault("model_type", "siglip_vision_model" if name == "siglip" else "qwen2")
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(conf, f, indent=2)
        dirs[name] = d
    return dirs, vision, text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True, help="the kestrel-train binary")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--out", default="/tmp/kestrel_vlm_stages")
    ap.add_argument("--smoke", action="store_true", help="tiny step counts (the end-to-end check, minutes on a CPU)")
    ap.add_argument("--pretrain-steps", type=int, default=None)
    ap.add_argument("--stage1-steps", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="stage 2 and from-scratch steps (default: the quickstart's)")
    ap.add_argument("--eval-every", type=int, default=None)
    ap.add_argument("--eval-samples", type=int, default=None)
    ap.add_argument("--target", type=float, default=0.9, help="caption accuracy to reach (tools/quickstart.sh: 0.9)")
    args = ap.parse_args()
    binary = os.path.abspath(args.bin)
    base = quickstart(args.device)
    full_steps = base["train"]["steps"]
    pre_steps = args.pretrain_steps or (20 if args.smoke else full_steps)
    s1_steps = args.stage1_steps or (10 if args.smoke else 200)
    steps = args.steps or (20 if args.smoke else full_steps)
    eval_every = args.eval_every or (10 if args.smoke else 50)
    eval_samples = args.eval_samples or (10 if args.smoke else base["data"]["eval_samples"])
    if args.smoke:
        base["train"]["batch_size"] = min(base["train"]["batch_size"], 32)
    base["data"]["eval_samples"] = eval_samples
    base["sample_every"] = 0
    os.makedirs(args.out, exist_ok=True)
    result = {"device": args.device, "smoke": args.smoke, "target_caption_accuracy": args.target,
              "batch_size": base["train"]["batch_size"], "target_data": dict(base["data"]),
              "pretrain_data": PRETRAIN_DATA, "steps": {"pretrain": pre_steps, "stage1": s1_steps,
                                                        "stage2": steps, "scratch": steps}}
    checks = []

    # (a) towers trained on another shapes variant
    pre = copy.deepcopy(base)
    pre["data"].update(PRETRAIN_DATA)
    pre["train"]["steps"] = pre_steps
    pre.update(out_dir=os.path.join(args.out, "pretrain"), checkpoint_every=pre_steps, keep_checkpoints=1, eval_every=0)
    log, secs = run(binary, pre, pre["out_dir"], "run")
    towers, vision, text = split_towers(last_checkpoint(pre["out_dir"]), pre["model"]["config"],
                                        os.path.join(args.out, "towers"))
    pre_acc = accuracy_curve(log, pre_steps)
    result["pretrain"] = {"seconds": secs, "accuracy_on_its_own_data": pre_acc[-1][1] if pre_acc else None}

    # (b) stage 1: projector only, towers from the folders
    s1 = copy.deepcopy(base)
    vlm = s1["model"]["config"]
    s1["model"] = {"type": "vlm", "vision_from": towers["siglip"], "text_from": towers["text"],
                   "config": {k: v for k, v in vlm.items() if k not in ("vision_config", "text_config")}}
    s1["train"].update(steps=s1_steps, trainable=["multi_modal_projector.*"])
    s1.update(out_dir=os.path.join(args.out, "stage1"), checkpoint_every=s1_steps, keep_checkpoints=1, eval_every=0)
    log, secs = run(binary, s1, s1["out_dir"], "run")
    s1_ckpt = last_checkpoint(s1["out_dir"])
    init_dir = os.path.join(args.out, "stage1_init")
    export(binary, s1["out_dir"], s1, init_dir)  # the same seed: the untrained VLM the run started from
    after, _ = st_read(os.path.join(s1_ckpt, "model.safetensors"))
    init, _ = st_read(os.path.join(init_dir, "model.safetensors"))
    # Towers: the stage 1 checkpoint against the folders it loaded (same dtype: both are checkpoints of this
    # device's precision), bit for bit. Projector: against the untrained VLM (exported in f32, so compared as
    # values): a relative L2 change above 1e-2, far above bf16 rounding (~2e-3).
    towers_total = [k for k in after if not k.startswith("multi_modal_projector.")]
    tower_same = [k for k in towers_total
                  if after[k] == (vision.get(k[len("vision_tower."):]) if k.startswith("vision_tower.")
                                  else text.get(k[len("language_model."):]))]
    proj = [k for k in after if k.startswith("multi_modal_projector.")]
    changes = {k: rel_change(after[k], init[k]) for k in proj}
    proj_moved = [k for k in proj if changes[k] > 1e-2]
    ok1 = len(tower_same) == len(towers_total) > 0 and len(proj_moved) == len(proj) > 0
    checks.append(ok1)
    s1_acc = accuracy_curve(log, s1_steps)
    result["stage1"] = {"seconds": secs, "tower_tensors_bitwise_unchanged": f"{len(tower_same)}/{len(towers_total)}",
                        "projector_tensors_changed": f"{len(proj_moved)}/{len(proj)}",
                        "projector_relative_l2_change": {k: (v if math.isfinite(v) else "from zeros")
                                                         for k, v in changes.items()},
                        "caption_accuracy_after": s1_acc[-1][1] if s1_acc else None, "pass": ok1}
    print(f"stage 1: {len(tower_same)}/{len(towers_total)} tower tensors bitwise unchanged, {len(proj_moved)}/"
          f"{len(proj)} projector tensors changed: {'PASS' if ok1 else 'FAIL'}", flush=True)

    # (c) stage 2 from stage 1's result, everything trainable
    s1_model = os.path.join(args.out, "stage1_model")
    export(binary, s1["out_dir"], s1, s1_model, weights=s1_ckpt)
    s2 = copy.deepcopy(base)
    s2["model"] = {"type": "vlm", "config_path": os.path.join(s1_model, "config.json"), "init_from": s1_model}
    s2["train"]["steps"] = steps
    s2.update(out_dir=os.path.join(args.out, "stage2"), eval_every=eval_every, checkpoint_every=0)
    log2, secs2 = run(binary, s2, s2["out_dir"], "run")
    # (d) from scratch
    sc = copy.deepcopy(base)
    sc["train"]["steps"] = steps
    sc.update(out_dir=os.path.join(args.out, "scratch"), eval_every=eval_every, checkpoint_every=0)
    logs, secss = run(binary, sc, sc["out_dir"], "run")

    c2, cs = accuracy_curve(log2, steps), accuracy_curve(logs, steps)
    r2, rs = first_reaching(c2, args.target), first_reaching(cs, args.target)
    half2, halfs = first_reaching(c2, 0.5), first_reaching(cs, 0.5)  # a second, earlier milestone
    result["stage2"] = {"seconds": secs2, "curve": c2, "steps_to_target": r2, "steps_to_50pct": half2}
    result["scratch"] = {"seconds": secss, "curve": cs, "steps_to_target": rs, "steps_to_50pct": halfs}
    fewer = r2 is not None and (rs is None or r2 < rs)
    result["stage2_reaches_target_in_fewer_steps"] = fewer
    ok = all(checks) and bool(c2) and bool(cs)
    result["pass"] = ok

    def fmt(r, curve):
        final = f"{100 * curve[-1][1]:.1f}%" if curve else "n/a"
        return (f"{r} steps" if r is not None else f"not within {steps}") + f" (final {final})"

    row = (f"| VLM stage 1 -> stage 2 vs scratch (shapes seed 7 / scale 1.5; towers pretrained on seed 11 / scale 1.0"
           f"{', smoke' if args.smoke else ''}) | {args.device} | stage 1: {s1_steps} steps, projector only "
           f"({result['stage1']['tower_tensors_bitwise_unchanged']} tower tensors bitwise unchanged); steps to "
           f"{100 * args.target:.0f}% held-out captions: stage 2 {fmt(r2, c2)} vs scratch {fmt(rs, cs)}; to 50%: "
           f"{half2 if half2 is not None else '-'} vs {halfs if halfs is not None else '-'}; eval every "
           f"{eval_every} over {eval_samples} images |")
    with open(os.path.join(args.out, "vlm_stages.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(args.out, "vlm_stages.md"), "w") as f:
        f.write(row + "\n")
    print("stage 2 accuracy curve:", " ".join(f"{s}:{100 * a:.0f}%" for s, a in c2))
    print("scratch accuracy curve:", " ".join(f"{s}:{100 * a:.0f}%" for s, a in cs))
    print(row)
    print(f"stage 2 reaches {100 * args.target:.0f}% in fewer steps than from scratch: {fewer}")
    print(f"wrote {os.path.join(args.out, 'vlm_stages.json')} and vlm_stages.md; checks: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
