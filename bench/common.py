"""Shared by the benchmarks: the machine's dense matmul FLOP/s, measured in the same run."""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def matmul_flops(n: int = 2048, dtype=torch.float32, device="cpu", seconds: float = 3.0) -> float:
    """Best FLOP/s of n x n @ n x n products over a few seconds (the hardware limit we compare against)."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(2):
        a @ b
    best = 0.0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sync(device)
        t = time.perf_counter()
        for _ in range(4):
            a @ b
        sync(device)
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t))
    return best


def sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def peak_memory_mb(device) -> float:
    if str(device).startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
