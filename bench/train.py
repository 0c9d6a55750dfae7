"""DALLE training throughput against the machine's matmul limit (MFU), in one run.

    .venv/bin/python bench/train.py                      # CPU shape from the issue, fp32, 2 threads
    .venv/bin/python bench/train.py --device cuda --dim 1024 --depth 12 --fmap 32 --batch 32 --precision bf16

MFU = model FLOP/s / measured dense matmul FLOP/s, with model FLOPs per step = 6 x parameters x tokens
plus attention (6 x 2 x layers x batch x seq^2 x heads x dim_head: QK^T and AV, forward and backward).
"""

from __future__ import annotations

import argparse
import time

import torch
from common import add_model_args, matmul_flops, matmul_params, model_config, sync

from dalle_pytorch.models.dalle import DALLE
from dalle_pytorch.training.loop import param_groups
from dalle_pytorch.training.metrics import peak_memory_mb


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--profile", action="store_true", help="also print where a step's time goes (torch.profiler)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    peak = matmul_flops(4096 if device.type == "cuda" else 2048, dtype, device)

    cfg = model_config(args)
    model = DALLE(cfg).to(device)
    opt = torch.optim.AdamW(
        param_groups(model, 0.01), lr=1e-4, fused=device.type == "cuda", foreach=device.type != "cuda"
    )
    step_model = torch.compile(model) if args.compile else model
    text = torch.randint(1, 1024, (args.batch, cfg.text_seq_len), device=device)
    image = torch.randint(0, 1024, (args.batch, cfg.image_seq_len), device=device)

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss, _ = step_model(text, image)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):  # warm-up (and compilation)
        step()
    sync(device)
    t = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync(device)
    dt = (time.perf_counter() - t) / args.steps

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(3):
                step()
            sync(device)
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=12))

    n_params = sum(p.numel() for p in model.parameters())
    embed = n_params - matmul_params(model)
    seq = cfg.seq_len
    tokens = args.batch * seq
    attn = 6 * 2 * cfg.depth * args.batch * seq**2 * cfg.heads * cfg.dim_head
    flops = 6 * (n_params - embed) * tokens + attn  # embedding lookups are not matmuls
    print(f"device {device}, {args.precision}, threads {torch.get_num_threads()}")
    print(
        f"model: {n_params / 1e6:.2f}M parameters ({(n_params - embed) / 1e6:.2f}M in matmuls), "
        f"sequence {seq}, batch {args.batch}"
    )
    print(f"measured dense matmul peak: {peak / 1e9:.1f} GFLOP/s")
    print(f"step: {dt * 1e3:.1f} ms, {tokens / dt:.0f} tokens/s, {args.batch / dt:.1f} images/s")
    print(f"model FLOPs per step: {flops / 1e9:.2f} GFLOP (attention {attn / flops:.1%})")
    print(f"achieved: {flops / dt / 1e9:.1f} GFLOP/s   MFU: {flops / dt / peak:.1%}")
    print(f"peak memory: {peak_memory_mb(device):.0f} MiB")


if __name__ == "__main__":
    main()
