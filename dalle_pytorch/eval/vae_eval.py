"""The VAE on the built-in dataset: PSNR, the parser's accuracy on reconstructions (the ceiling for any
generator), codebook usage; with a feature extractor's config also reconstruction FID and its friends (rfid, rkid,
precision, recall), the images in DIR/reference and DIR/reconstructed."""

from __future__ import annotations

import math

import torch

from ..data.shapes import ShapesDataset
from ..models.vae import codebook_stats
from .fidelity import settings
from .on_data import reconstruction_figures, score_sets
from .parse import parse_image, score
from .summary import VALIDATION_SEED, summarize


@torch.no_grad()
def evaluate_vae(
    vae, n: int = 512, batch_size: int = 64, split: str = "train", fidelity=None, out: str = "", fid_images: int = 0
) -> dict:
    """`fid_images` (with `fidelity`): how many of the reconstructions are scored against their originals."""
    device = next(vae.parameters()).device
    n = max(n, fid_images)
    data = ShapesDataset(n, vae.image_size, seed=VALIDATION_SEED, split=split)
    mse, scores, codes, recons = 0.0, [], [], []
    for start in range(0, n, batch_size):
        idx = range(start, min(start + batch_size, n))
        images = torch.stack([data[i][0] for i in idx]).to(device)
        ids = vae.get_codebook_indices(images)
        recon = vae.decode(ids)
        codes.append(ids.cpu())
        if fidelity is not None:
            recons.append(recon.clamp(0, 1).cpu())
        mse += torch.nn.functional.mse_loss(recon, images, reduction="sum").item()
        scores += [score(data.scene(i), parse_image(r)) for i, r in zip(idx, recon.cpu())]
    mse /= n * images[0].numel()
    stats = codebook_stats(torch.cat(codes), vae.num_tokens)
    result = {
        "psnr": -10 * math.log10(max(mse, 1e-10)),
        "parse": summarize(scores),
        **{k: v.item() for k, v in stats.items()},
    }
    if fidelity is not None:
        reference = torch.stack([data[i][0] for i in range(fid_images)])
        found = score_sets(out, reference, fidelity, reconstructed=torch.cat(recons)[:fid_images])["reconstructed"]
        result.update(num_images=fid_images, fidelity=settings(fidelity), **reconstruction_figures(found))
    return result
