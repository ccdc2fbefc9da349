#!/usr/bin/env python3
"""Quality A/B on real text: the same decoder trained twice with two configs (e.g. exact vs compact AdamW,
issue 21; bf16 vs FP8 linear layers, issue 23), both loss curves in one SVG, and the final losses
compared against a bound (the mean of the last 10 logged losses; B within BOUND of A).

The corpus is found on the machine: the Python standard library's sources and docs (sysconfig's
stdlib folder; .py, .txt, .rst files), one document per file, tokenised by `kestrel-train tokenize`
with the byte tokenizer (ids < 260, well inside any vocabulary). Both runs read the same token file
in the same order, with the same seed; they differ only in their configs and --b-set entries
(gradient clipping is off in both: the compact mode's in-backward update cannot clip). Every 20th file is
held out (never trained on): both runs evaluate the same held-out sequences every --eval-every steps and
at the end (data.eval_files), and the bound is checked on that final held-out loss (the last 10 training
losses, each on one batch, swing with the batch's file; they are reported too).

usage: bench/quality_ab.py --bin BIN [--a configs/llama_1b5_8k.json] [--b configs/llama_1b5_8k_compact.json]
         [--a-label ...] [--b-label ...] [--b-set key=value ...] [--bound 0.02] [--steps 300] [--seeds 1,2,3]
         [--out bench/compact_quality] [--set key=value ...]   (--set: applied to both runs)
  compact AdamW (issue 21): the defaults.
  FP8 (issue 23): --a configs/llama_1b5_8k_selective.json --b configs/llama_1b5_8k_selective_fp8.json
         --a-label "bf16" --b-label "FP8 linear layers" --bound 0.01 --steps 500 --out bench/fp8_quality
Writes OUT.svg (both curves), OUT.json (losses, final-loss ratio) and prints a RESULTS.md row.
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import sysconfig


def build_corpus(work, limit_bytes, heldout_bytes):
    """One JSON line per stdlib file ({"text": ...}): every 20th file goes to the held-out corpus (until
    heldout_bytes), the others to the training corpus (until limit_bytes). Returns both paths."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    files += sorted(glob.glob(os.path.join(root, "**", "*.txt"), recursive=True))
    files += sorted(glob.glob("/usr/share/doc/python3*/**/*.rst", recursive=True))
    paths = [os.path.join(work, "corpus.jsonl"), os.path.join(work, "heldout.jsonl")]
    limits = [limit_bytes, heldout_bytes]
    totals = [0, 0]
    with open(paths[0], "w") as train_out, open(paths[1], "w") as held_out:
        outs = [train_out, held_out]
        for i, f in enumerate(files):
            k = 1 if i % 20 == 19 else 0
            if totals[k] >= limits[k]:
                continue
            try:
                text = open(f, encoding="utf-8").read()
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip():
                continue
            outs[k].write(json.dumps({"text": text}) + "\n")
            totals[k] += len(text)
    print(f"corpus: {totals[0] / 1e6:.1f} MB of text from {root} for training, {totals[1] / 1e6:.1f} MB held out "
          f"(every 20th file)", flush=True)
    return paths


def tokenize(bin_dir, corpus, out):
    r = subprocess.run([os.path.join(bin_dir, "kestrel-train"), "tokenize", "--tokenizer", "byte", "--output", out,
                        corpus], capture_output=True, text=True, check=True)
    print(r.stdout.strip(), flush=True)
    # "... document separator id N (data.doc_start_token)"
    words = r.stdout.split("separator id")[1].split()
    return int(words[0])


def train(bin_dir, config, label, tokens, doc_start, steps, out_dir, sets, heldout=None):
    """Trains; returns the per-step (step, loss, tok/s) and the held-out evaluations [(step, loss)]
    (data.eval_files = heldout: every eval_every steps and at the end)."""
    args = [os.path.join(bin_dir, "kestrel-train"), "--config", config, "--overwrite-out-dir",
            "--set", f"data.train_files={tokens}", "--set", f"data.doc_start_token={doc_start}",
            "--set", f"train.steps={steps}", "--set", "train.grad_clip=0", "--set", f"out_dir={out_dir}",
            "--set", "log_every=25"]
    if heldout:
        path, samples, every = heldout
        args += ["--set", f"data.eval_files={path}", "--set", f"data.eval_samples={samples}",
                 "--set", f"eval_every={every}"]
    for s in sets:
        args += ["--set", s]
    print(f"== {label}: {' '.join(args)}", flush=True)
    subprocess.run(args, check=True)
    losses = []
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            losses.append((row["step"], row["loss"], row.get("tokens_per_s", 0.0)))
    evals = []
    if heldout and os.path.exists(os.path.join(out_dir, "eval.jsonl")):
        with open(os.path.join(out_dir, "eval.jsonl")) as f:
            evals = [(r["step"], r["eval_loss"]) for r in map(json.loads, f)]
    return losses, evals


def svg(curves, title, path, width=720, height=420):
    """Loss against step for each (label, colour, [(step, loss)]), as a plain SVG."""
    pad_l, pad_r, pad_t, pad_b = 60, 20, 36, 44
    xs = [s for _, _, c in curves for s, _ in c]
    ys = [l for _, _, c in curves for _, l in c]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    y0 -= 0.05 * (y1 - y0 or 1)
    y1 += 0.05 * (y1 - y0 or 1)

    def px(s):
        return pad_l + (s - x0) / ((x1 - x0) or 1) * (width - pad_l - pad_r)

    def py(l):
        return height - pad_b - (l - y0) / ((y1 - y0) or 1) * (height - pad_t - pad_b)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="12">', f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>']
    for i in range(6):  # grid and tick labels
        yl = y0 + i * (y1 - y0) / 5
        out.append(f'<line x1="{pad_l}" x2="{width - pad_r}" y1="{py(yl):.1f}" y2="{py(yl):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{pad_l - 6}" y="{py(yl) + 4:.1f}" text-anchor="end">{yl:.2f}</text>')
        xl = x0 + i * (x1 - x0) / 5
        out.append(f'<text x="{px(xl):.1f}" y="{height - pad_b + 16}" text-anchor="middle">{xl:.0f}</text>')
    out.append(f'<text x="{width / 2}" y="{height - 8}" text-anchor="middle">step</text>')
    out.append(f'<text x="14" y="{height / 2}" transform="rotate(-90 14 {height / 2})" text-anchor="middle">'
               f'loss</text>')
    for k, (label, colour, c) in enumerate(curves):
        pts = " ".join(f"{px(s):.1f},{py(l):.1f}" for s, l in c)
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{pts}"/>')
        out.append(f'<text x="{width - pad_r - 6}" y="{pad_t + 16 * (k + 1)}" text-anchor="end" '
                   f'fill="{colour}">{label}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def final_loss(losses, last=10):
    tail = [l for _, l, _ in losses[-last:]]
    return sum(tail) / len(tail)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="folder with kestrel-train and libkestrel.so")
    ap.add_argument("--a", default="configs/llama_1b5_8k.json")
    ap.add_argument("--b", default="configs/llama_1b5_8k_compact.json")
    ap.add_argument("--a-label", default="exact AdamW (f32 master, f32 moments)")
    ap.add_argument("--b-label", default="compact (bf16 no master, q8 moments, in backward)")
    ap.add_argument("--b-set", action="append", default=[], help="key=value for run B only")
    ap.add_argument("--bound", type=float, default=0.02, help="largest relative final-loss difference")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--corpus-mb", type=float, default=64.0, help="text to tokenise (MB)")
    ap.add_argument("--heldout-mb", type=float, default=4.0,
                    help="held-out text (every 20th file, never trained on); 0 = no held-out evaluation")
    ap.add_argument("--eval-samples", type=int, default=48, help="held-out sequences per evaluation")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--work", default="runs/quality_ab")
    ap.add_argument("--out", default="bench/compact_quality")
    ap.add_argument("--set", action="append", default=[], help="key=value for both runs")
    ap.add_argument("--a-from", default=None,
                    help="reuse run A's losses from an earlier OUT.json of the same --a, --steps and --set "
                         "(recipe sweeps; the summary names the file, and the final evidence re-runs both)")
    ap.add_argument("--seeds", default="",
                    help="comma-separated train.seed values: one A/B pair per seed (both runs of a pair share it); "
                         "the bound is checked on the mean ratio, and the spread across seeds is reported")
    a = ap.parse_args()
    seeds = [int(x) for x in a.seeds.split(",") if x.strip()]
    if seeds and a.a_from:
        sys.exit("--seeds and --a-from do not combine (a reused run A has one seed)")
    os.makedirs(a.work, exist_ok=True)
    tokens = os.path.join(a.work, "stdlib_bytes.bin")
    corpus, heldout_corpus = build_corpus(a.work, int(a.corpus_mb * 1e6), int(a.heldout_mb * 1e6))
    doc_start = tokenize(a.bin, corpus, tokens)
    heldout = None
    if a.heldout_mb > 0:
        heldout_tokens = os.path.join(a.work, "heldout_bytes.bin")
        tokenize(a.bin, heldout_corpus, heldout_tokens)
        heldout = (heldout_tokens, a.eval_samples, a.eval_every)
    pairs = []  # per seed: (seed, ra, ea, rb, eb)
    for seed in seeds:
        extra = [f"train.seed={seed}"]
        ra, ea = train(a.bin, a.a, f"{a.a_label} (seed {seed})", tokens, doc_start, a.steps,
                       os.path.join(a.work, f"a_{seed}"), a.set + extra, heldout)
        rb, eb = train(a.bin, a.b, f"{a.b_label} (seed {seed})", tokens, doc_start, a.steps,
                       os.path.join(a.work, f"b_{seed}"), a.set + a.b_set + extra, heldout)
        pairs.append((seed, ra, ea, rb, eb))
    if pairs:
        _, ra, ea, rb, eb = pairs[0]
    elif a.a_from:
        prev = json.load(open(a.a_from))
        if prev["a"] != a.a or prev["steps"] != a.steps:
            sys.exit(f"--a-from {a.a_from}: it ran {prev['a']} for {prev['steps']} steps, not {a.a} for {a.steps}")
        ra = [tuple(r) for r in prev["losses_a"]]
        ea = [tuple(r) for r in prev.get("heldout_a", [])]
        if heldout and not ea:
            sys.exit(f"--a-from {a.a_from}: it has no held-out evaluations; run with --heldout-mb 0 or without --a-from")
        print(f"== {a.a_label}: losses reused from {a.a_from}", flush=True)
    else:
        ra, ea = train(a.bin, a.a, a.a_label, tokens, doc_start, a.steps, os.path.join(a.work, "a"), a.set, heldout)
    if not pairs:
        rb, eb = train(a.bin, a.b, a.b_label, tokens, doc_start, a.steps, os.path.join(a.work, "b"),
                       a.set + a.b_set, heldout)
    fa, fb = final_loss(ra), final_loss(rb)
    ratio = fb / fa
    # The held-out loss at the end (the same sequences for both runs, never trained on): the less noisy
    # final loss, and the one the bound is checked on when there is one.
    ha = ea[-1][1] if ea else None
    hb = eb[-1][1] if eb else None
    heldout_ratio = hb / ha if ha and hb else None
    curves = [(a.a_label, "#1f77b4", [(s, l) for s, l, _ in ra]), (a.b_label, "#d62728", [(s, l) for s, l, _ in rb])]
    title = f"{a.steps} steps on the Python stdlib (byte tokens): final loss {fa:.4f} vs {fb:.4f} ({100 * (ratio - 1):+.2f}%)"
    if heldout_ratio:
        curves += [(a.a_label + " held-out", "#17becf", ea), (a.b_label + " held-out", "#ff7f0e", eb)]
        title += f"; held-out {ha:.4f} vs {hb:.4f} ({100 * (heldout_ratio - 1):+.2f}%)"
    svg(curves, title, a.out + ".svg")
    checked = heldout_ratio if heldout_ratio else ratio
    per_seed = []
    for seed, pra, pea, prb, peb in pairs:
        row = {"seed": seed, "final_loss_a": final_loss(pra), "final_loss_b": final_loss(prb)}
        row["ratio"] = row["final_loss_b"] / row["final_loss_a"]
        if pea and peb:
            row["heldout_ratio"] = peb[-1][1] / pea[-1][1]
        per_seed.append(row)
    if per_seed:  # the bound is checked on the mean over the seeds
        key = "heldout_ratio" if all("heldout_ratio" in r for r in per_seed) else "ratio"
        vals = [r[key] for r in per_seed]
        checked = sum(vals) / len(vals)
        spread = max(vals) - min(vals)
        print(f"seeds {seeds}: {key} " + ", ".join(f"{100 * (v - 1):+.2f}%" for v in vals) +
              f"; mean {100 * (checked - 1):+.2f}%, spread {100 * spread:.2f} points", flush=True)
    summary = {"steps": a.steps, "a": a.a, "b": a.b, "a_label": a.a_label, "b_label": a.b_label, "b_set": a.b_set,
               "a_from": a.a_from, "final_loss_a": fa, "final_loss_b": fb, "ratio": ratio, "bound": a.bound,
               "heldout_final_a": ha, "heldout_final_b": hb, "heldout_ratio": heldout_ratio,
               "bound_checked_on": ("held-out loss" if heldout_ratio else "last 10 training losses") +
                                   (f", mean over {len(per_seed)} seeds" if per_seed else ""),
               "within_bound": abs(checked - 1) <= a.bound, "losses_a": ra, "losses_b": rb,
               "heldout_a": ea, "heldout_b": eb, "seeds": per_seed,
               "mean_ratio_checked": checked if per_seed else None}
    with open(a.out + ".json", "w") as f:
        json.dump(summary, f)
    tps = lambda L: sum(t for _, _, t in L[2:]) / max(1, len(L) - 2)
    held = (f"held-out {ha:.4f} vs {hb:.4f} ({100 * (heldout_ratio - 1):+.2f}%)" if heldout_ratio else "no held-out")
    print(f"| {a.b_label} vs {a.a_label} | {a.steps} steps | {fa:.4f} | {fb:.4f} | "
          f"{100 * (ratio - 1):+.2f}% | {held} (bound {100 * a.bound:.0f}% on {summary['bound_checked_on']}) | "
          f"{tps(ra):.0f} vs {tps(rb):.0f} tok/s | {a.out}.svg |")
    return 0 if summary["within_bound"] else 1


if __name__ == "__main__":
    sys.exit(main())
