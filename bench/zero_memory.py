"""Per-rank ZeRO memory measured from the live tensors, against the ZeRO paper's formulas.

    .venv/bin/deepspeed --num_gpus 2 bench/zero_memory.py          # CPU ranks over Gloo here

ZeRO-1/2: optimizer-state bytes per rank = the fp32 master partition + Adam's two moments, each a 1/N
partition: 12 Psi / N (the paper's K = 12). ZeRO-3: parameter bytes per rank = 4 Psi / N in fp32 (2 Psi / N in
16-bit). Psi = trainable parameters; N = ranks.
"""

from __future__ import annotations

import os
import sys

import deepspeed
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dalle_pytorch.models.dalle import DALLE, DALLEConfig  # noqa: E402
from distributed.deepspeed_config import build_config  # noqa: E402


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def measure(stage: int, world: int) -> tuple[int, float, float]:
    torch.manual_seed(0)
    cfg = DALLEConfig(
        dim=256,
        depth=4,
        heads=4,
        dim_head=64,
        text_seq_len=32,
        num_text_tokens=1024,
        num_image_tokens=1024,
        image_fmap_size=16,
    )
    model = DALLE(cfg)
    psi = sum(p.numel() for p in model.parameters())
    config, _ = build_config(
        micro_batch=2,
        accumulation_steps=1,
        world_size=world,
        clip_grad_norm=1.0,
        precision="fp32",
        zero_stage=stage,
        on_gpu=False,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    text = torch.randint(1, 1024, (2, 32))
    image = torch.randint(0, 1024, (2, 256))
    loss, _ = engine(text, image)
    engine.backward(loss)
    engine.step()  # Adam's moments exist only after a step
    if stage in (1, 2):
        moments = tensor_bytes(
            v for s in optimizer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0
        )
        master = tensor_bytes(optimizer.single_partition_of_fp32_groups)
        measured, formula = moments + master, 12 * psi / world
    else:
        measured = tensor_bytes(p.ds_tensor for p in engine.module.parameters())
        formula = 4 * psi / world
    return psi, measured, formula


def main():
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl", verbose=False)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    rows = [(stage, *measure(stage, world)) for stage in (1, 2, 3)]
    if rank == 0:
        print(f"\nper-rank bytes at N = {world} (rank 0), fp32, Adam")
        print(f"{'stage':>6} {'what':>24} {'params':>10} {'measured MiB':>13} {'formula MiB':>12} {'ratio':>7}")
        for stage, psi, measured, formula in rows:
            what = "optimizer states" if stage < 3 else "parameters"
            print(
                f"{'ZeRO-' + str(stage):>6} {what:>24} {psi:>10} {measured / 2**20:>13.2f} {formula / 2**20:>12.2f} "
                f"{measured / formula:>7.3f}"
            )


if __name__ == "__main__":
    main()
