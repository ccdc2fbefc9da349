#!/usr/bin/env python3
"""Runs kestrel-train while an external observer samples the process's GPU memory through NVML.

The north-star evidence (issue: 9B / 250k vocabulary / 8k context inside 40 GiB): this script
starts `kestrel-train --config CONFIG [--set ...]`, polls NVML every --interval-ms (default 5 ms)
for the memory the process holds on the GPU (per-process accounting; where the driver does not
report processes, the device's used memory minus what was used before the run), and prints, next
to Kestrel's own footprint peak from the run's metrics, the NVML peak, the throughput of the steps
after the first --warmup, the optimizer and GPU-idle times per step, the host peak (RSS, pinned) and
the first/last loss. A JSON summary goes to --json.

It generates the run's llm.c token file when it is missing (uint32, documents starting with token 0
built from repeated random phrases over a Zipf-like vocabulary, so the loss falls quickly).

usage: bench/train_memory_run.py --bin .carry --config configs/llama_9b_250k_8k.json \
         [--set train.grad_accum=8 ...] [--json out.json] [--label name]
"""
import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import threading
import time

GIB = 1 << 30


class Nvml:
    class Memory(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    class Process(ctypes.Structure):  # nvmlProcessInfo_t (v2/v3 layout)
        _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                    ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]

    def __init__(self, index=0):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        assert self.lib.nvmlInit_v2() == 0, "nvmlInit failed"
        self.handle = ctypes.c_void_p()
        assert self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)) == 0
        self.get_procs = getattr(self.lib, "nvmlDeviceGetComputeRunningProcesses_v3", None) or \
            getattr(self.lib, "nvmlDeviceGetComputeRunningProcesses_v2")

    def used(self):
        m = Nvml.Memory()
        self.lib.nvmlDeviceGetMemoryInfo(self.handle, ctypes.byref(m))
        return m.used

    def process_used(self, pid):
        count = ctypes.c_uint(64)
        infos = (Nvml.Process * 64)()
        if self.get_procs(self.handle, ctypes.byref(count), infos) != 0:
            return None
        for i in range(count.value):
            if infos[i].pid == pid and infos[i].usedGpuMemory < (1 << 62):
                return infos[i].usedGpuMemory
        return None


def make_tokens(path, vocab, n_tokens, seed=1):
    import numpy as np
    rng = np.random.default_rng(seed)
    # 4096 phrases of 16-128 tokens drawn from a Zipf-like distribution over [1, vocab).
    ranks = np.arange(1, vocab, dtype=np.float64)
    p = 1.0 / ranks ** 1.1
    p /= p.sum()
    phrases = [rng.choice(np.arange(1, vocab), size=int(rng.integers(16, 129)), p=p).astype(np.uint32)
               for _ in range(4096)]
    out = []
    total = 0
    while total < n_tokens:
        doc = [np.zeros(1, np.uint32)]
        length = int(rng.integers(1024, 8192))
        got = 1
        while got < length:
            ph = phrases[int(rng.integers(0, len(phrases)))]
            doc.append(ph)
            got += len(ph)
        d = np.concatenate(doc)
        out.append(d)
        total += len(d)
    toks = np.concatenate(out)[:n_tokens]
    header = np.zeros(256, np.int32)
    header[0], header[1], header[2] = 20240801, 7, len(toks)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        f.write(header.tobytes())
        f.write(toks.astype(np.uint32).tobytes())
    os.replace(path + ".tmp", path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=".carry")
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the throughput")
    ap.add_argument("--interval-ms", type=float, default=5.0)
    ap.add_argument("--json", default="")
    ap.add_argument("--label", default="")
    ap.add_argument("--tokens", type=int, default=4_000_000)
    ap.add_argument("--timeout", type=float, default=540)
    a = ap.parse_args()

    cfg = json.load(open(a.config))
    overrides = dict(s.split("=", 1) for s in a.set)
    files = overrides.get("data.train_files", cfg["data"]["train_files"])
    vocab = cfg["model"]["config"]["vocab_size"]
    if not os.path.exists(files):
        t0 = time.time()
        make_tokens(files, vocab, a.tokens)
        print(f"[tokens] wrote {files} ({a.tokens} tokens, vocab {vocab}) in {time.time() - t0:.1f} s", flush=True)
    out_dir = overrides.get("out_dir", cfg.get("out_dir", "runs/train"))
    cmd = [os.path.join(a.bin, "kestrel-train"), "--config", a.config]
    for s in a.set:
        cmd += ["--set", s]
    print("[run] " + " ".join(cmd), flush=True)

    nvml = Nvml()
    baseline = nvml.used()
    peak = {"process": 0, "device": 0, "samples": 0, "process_seen": False}
    stop = threading.Event()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, LD_LIBRARY_PATH=a.bin + ":" + os.environ.get("LD_LIBRARY_PATH", "")))

    def sample():
        while not stop.is_set():
            pu = nvml.process_used(proc.pid)
            if pu is not None:
                peak["process_seen"] = True
                peak["process"] = max(peak["process"], pu)
            peak["device"] = max(peak["device"], nvml.used() - baseline)
            peak["samples"] += 1
            time.sleep(a.interval_ms / 1e3)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t_start = time.time()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            print(line, end="", flush=True)
            if time.time() - t_start > a.timeout:
                proc.kill()
                print("[run] timeout: killed", flush=True)
                break
        rc = proc.wait()
    finally:
        stop.set()
        th.join()
    wall = time.time() - t_start

    rows = []
    mpath = os.path.join(out_dir, "metrics.jsonl")
    if os.path.exists(mpath):
        rows = [json.loads(l) for l in open(mpath) if l.strip()]
    timed = rows[a.warmup:] if len(rows) > a.warmup else rows
    tokps = statistics.median([r["tokens_per_s"] for r in timed]) if timed else 0.0
    nvml_peak = peak["process"] if peak["process_seen"] else peak["device"]
    summary = {
        "label": a.label or os.path.basename(a.config),
        "rc": rc,
        "steps": len(rows),
        "first_loss": rows[0]["loss"] if rows else None,
        "last_loss": rows[-1]["loss"] if rows else None,
        "tok_s_median": tokps,
        "step_ms_median": statistics.median([r["ms"] for r in timed]) if timed else None,
        # (6 x parameters x tokens + attention FLOPs) / step time / the bf16 peak, as kestrel-train logs it
        "mfu_median": statistics.median([r.get("mfu", 0) for r in timed]) if timed else None,
        "optimizer_ms_median": statistics.median([r.get("optimizer_ms", 0) for r in timed]) if timed else None,
        "gpu_idle_ms_median": statistics.median([r.get("gpu_idle_ms", 0) for r in timed]) if timed else None,
        "kestrel_peak_footprint_gib": max((r.get("peak_footprint_bytes", 0) for r in rows), default=0) / GIB,
        "kestrel_peak_in_use_gib": max((r.get("peak_bytes", 0) for r in rows), default=0) / GIB,
        "nvml_peak_gib": nvml_peak / GIB,
        "nvml_source": "process" if peak["process_seen"] else "device used - baseline",
        "nvml_samples": peak["samples"],
        "host_rss_peak_gib": max((r.get("host", {}).get("rss_peak_bytes", 0) for r in rows), default=0) / GIB,
        "host_pinned_peak_gib": max((r.get("host", {}).get("pinned_peak_bytes", 0) for r in rows), default=0) / GIB,
        "wall_s": wall,
        "command": " ".join(cmd),
    }
    print("[summary] " + json.dumps(summary), flush=True)
    print(f"| {summary['label']} | rc {rc} | steps {summary['steps']} | loss {summary['first_loss']} -> "
          f"{summary['last_loss']} | {tokps:.0f} tok/s | MFU {100 * (summary['mfu_median'] or 0):.1f}% | NVML peak {summary['nvml_peak_gib']:.2f} GiB "
          f"({summary['nvml_source']}, {peak['samples']} samples) | Kestrel footprint peak "
          f"{summary['kestrel_peak_footprint_gib']:.2f} GiB (in use {summary['kestrel_peak_in_use_gib']:.2f}) | optimizer {summary['optimizer_ms_median']} ms, "
          f"GPU idle {summary['gpu_idle_ms_median']} ms | host RSS peak {summary['host_rss_peak_gib']:.1f} GiB, "
          f"pinned {summary['host_pinned_peak_gib']:.2f} GiB |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if rc == 0 else rc


if __name__ == "__main__":
    sys.exit(main())
