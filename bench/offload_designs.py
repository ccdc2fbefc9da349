#!/usr/bin/env python3
"""The two designs for AdamW state off the device, measured on the GPU machine's link and host.

(a) update on the CPU (what Kestrel ships): per parameter the host reads and writes 12 bytes of f32
    state, reads a 2-byte bf16 gradient and writes a 2-byte bf16 parameter; PCIe carries 2 bytes
    each way. Its cost is the host update (measured by kestrel-train's step log).
(b) state streamed through the GPU: per parameter 12 bytes of state host->device and 12 back, the
    update on the device. Its floor is the time of those copies at the measured duplex bandwidth.
This script measures the pinned H2D, D2H and simultaneous H2D+D2H bandwidth and pageable H2D
(torch, 1 GiB buffers), and prints design (b)'s floor for N parameters.

usage: bench/offload_designs.py [--params 9.03e9]
"""
import argparse
import time

import torch


def timed(fn, reps=5):
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=9.03e9)
    a = ap.parse_args()
    n = 1 << 30
    dev_a = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev_b = torch.empty(n, dtype=torch.uint8, device="cuda")
    host_a = torch.empty(n, dtype=torch.uint8).pin_memory()
    host_b = torch.empty(n, dtype=torch.uint8).pin_memory()
    pageable = torch.empty(n, dtype=torch.uint8)
    pageable.fill_(1)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    h2d = n / timed(lambda: dev_a.copy_(host_a, non_blocking=True)) / 1e9
    d2h = n / timed(lambda: host_b.copy_(dev_b, non_blocking=True)) / 1e9

    def both():
        with torch.cuda.stream(s1):
            dev_a.copy_(host_a, non_blocking=True)
        with torch.cuda.stream(s2):
            host_b.copy_(dev_b, non_blocking=True)

    duplex = n / timed(both) / 1e9  # GB/s each way
    pageable_h2d = n / timed(lambda: dev_a.copy_(pageable), reps=3) / 1e9
    p = a.params
    floor_b = p * 12 / (duplex * 1e9)
    print(f"pinned H2D {h2d:.1f} GB/s | pinned D2H {d2h:.1f} GB/s | both at once {duplex:.1f} GB/s each way | "
          f"pageable H2D {pageable_h2d:.1f} GB/s")
    print(f"design (b) floor for {p / 1e9:.2f}B parameters: 12 B/param each way at {duplex:.1f} GB/s = "
          f"{floor_b:.2f} s per step, with every byte of state pinned ({p * 12 / 2**30:.1f} GiB; the host pins at most "
          f"~64 GiB); design (a) moves 2 B/param each way: {p * 2 / (duplex * 1e9):.2f} s of copies")


if __name__ == "__main__":
    main()
