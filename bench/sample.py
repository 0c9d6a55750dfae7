"""Sampling speed against the compute bound, in one run.

    .venv/bin/python bench/sample.py            # image 64x64 with 16x16 tokens, text 32, dim 256, depth 4, batch 4

The bound: 2 x parameters x generated tokens FLOPs at the measured dense matmul FLOP/s. The KV cache
makes the real work close to that (each new token is one row through the model).
"""

from __future__ import annotations

import argparse
import time

import torch
from common import add_model_args, matmul_flops, matmul_params, model_config, sync

from dalle_pytorch.dalle import DALLE
from dalle_pytorch.sampling import generate_image_tokens


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--no_cache", action="store_true", help="also time the uncached path")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    peak = matmul_flops(2048, torch.float32, device)
    cfg = model_config(args)
    model = DALLE(cfg).eval().to(device)
    text = torch.randint(1, 1024, (args.batch, cfg.text_seq_len), device=device)
    n_params = matmul_params(model)

    def run(use_cache):
        g = torch.Generator(device).manual_seed(0)
        generate_image_tokens(model, text, generator=g, use_cache=use_cache)

    results = {}
    for use_cache in [True, False] if args.no_cache else [True]:
        run(use_cache)
        sync(device)
        t = time.perf_counter()
        for _ in range(args.repeats):
            run(use_cache)
        sync(device)
        results[use_cache] = (time.perf_counter() - t) / args.repeats
    generated = args.batch * cfg.image_seq_len
    bound = 2 * n_params * generated / peak  # seconds at the matmul peak
    dt = results[True]
    print(
        f"device {device}, fp32, threads {torch.get_num_threads()}; "
        f"{n_params / 1e6:.2f}M matmul parameters, batch {args.batch}"
    )
    print(f"measured dense matmul peak: {peak / 1e9:.1f} GFLOP/s")
    print(f"KV cache: {dt:.2f} s per batch, {args.batch / dt:.2f} images/s, {generated / dt:.0f} tokens/s")
    print(f"compute bound: {bound:.3f} s per batch; achieved {bound / dt:.1%} of the bound")
    if False in results:
        print(f"without cache: {results[False]:.2f} s per batch ({results[False] / dt:.1f}x slower)")


if __name__ == "__main__":
    main()
