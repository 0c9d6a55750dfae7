"""The VAE on the built-in dataset: PSNR, the parser's accuracy on reconstructions (the ceiling for any
generator), codebook usage."""

from __future__ import annotations

import math

import torch

from ..data.shapes import ShapesDataset
from ..models.vae import codebook_stats
from .parse import parse_image, score
from .summary import VALIDATION_SEED, summarize


@torch.no_grad()
def evaluate_vae(vae, n: int = 512, batch_size: int = 64, split: str = "train") -> dict:
    device = next(vae.parameters()).device
    data = ShapesDataset(n, vae.image_size, seed=VALIDATION_SEED, split=split)
    mse, scores, codes = 0.0, [], []
    for start in range(0, n, batch_size):
        idx = range(start, min(start + batch_size, n))
        images = torch.stack([data[i][0] for i in idx]).to(device)
        ids = vae.get_codebook_indices(images)
        recon = vae.decode(ids)
        codes.append(ids.cpu())
        mse += torch.nn.functional.mse_loss(recon, images, reduction="sum").item()
        scores += [score(data.scene(i), parse_image(r)) for i, r in zip(idx, recon.cpu())]
    mse /= n * images[0].numel()
    stats = codebook_stats(torch.cat(codes), vae.num_tokens)
    return {
        "psnr": -10 * math.log10(max(mse, 1e-10)),
        "parse": summarize(scores),
        **{k: v.item() for k, v in stats.items()},
    }
