"""Replays the allocation trace written by bench_cuda_runtime (lines "a <id> <bytes>" / "f <id>")
through PyTorch's CUDA caching allocator and prints peak reserved / peak allocated for comparison.
Usage: python3 bench/alloc_trace_vs_torch.py alloc_trace.txt"""
import sys

import torch


def main(path):
    torch.cuda.init()
    live = {}
    torch.cuda.reset_peak_memory_stats()
    with open(path) as f:
        for line in f:
            p = line.split()
            if p[0] == "a":
                live[p[1]] = torch.empty(int(p[2]), dtype=torch.uint8, device="cuda")
            else:
                del live[p[1]]
    res = torch.cuda.max_memory_reserved()
    used = torch.cuda.max_memory_allocated()
    print(f"| training trace, PyTorch {torch.__version__} caching allocator | peak reserved {res / 2**20:.0f} MiB / "
          f"peak allocated {used / 2**20:.0f} MiB = {res / used:.3f} | |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "alloc_trace.txt")
