"""Shared by the benchmarks: the machine's dense matmul FLOP/s, measured in the same run."""

from __future__ import annotations

import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dalle_pytorch.models.dalle import DALLEConfig  # noqa: E402


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


def add_model_args(p) -> None:
    """The DALLE shape both benches use: 64x64 images as 16x16 tokens, text 32, dim 256, depth 4."""
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim_head", type=int, default=64)
    p.add_argument("--fmap", type=int, default=16, help="image token grid side (64x64 images, 4x downsampling)")
    p.add_argument("--text_seq_len", type=int, default=32)


def model_config(args) -> DALLEConfig:
    return DALLEConfig(
        dim=args.dim,
        depth=args.depth,
        heads=args.heads,
        dim_head=args.dim_head,
        text_seq_len=args.text_seq_len,
        num_text_tokens=1024,
        num_image_tokens=1024,
        image_fmap_size=args.fmap,
    )


def matmul_params(model) -> int:
    """Parameters used in matmuls: all but the embedding tables and the bos vector (lookups, not FLOPs)."""
    return sum(p.numel() for n, p in model.named_parameters() if not ("emb" in n or "pos" in n or n == "bos"))


def one_worker_rate(items, n: int) -> float:
    """Items/s of the iterator `items` on one torch thread, as a DataLoader worker runs it; its first item (the
    first-use costs: imports, the first shard's open) left out."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        next(items)
        t = time.perf_counter()
        for _ in range(n):
            next(items)
        dt = time.perf_counter() - t
        items.close()
    finally:
        torch.set_num_threads(threads)
    return n / dt
