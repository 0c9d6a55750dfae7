"""DALLE on the built-in dataset: bits per image token on validation pairs, and generated images read
back by the parser, on seen colour-shape combinations and on held-out ones."""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torchvision.utils import save_image

from ..data.shapes import ShapesDataset
from ..models.sampling import generate_image_tokens
from ..training.export import load_dalle
from .evaluate import VALIDATION_SEED, summarize
from .parse import parse_image, score


@torch.no_grad()
def bits_per_image_token(dalle, vae, tokenizer, n: int = 256, batch_size: int = 64) -> float:
    data = ShapesDataset(n, vae.image_size, seed=VALIDATION_SEED, split="train")
    total, count = 0.0, 0
    t = dalle.cfg.text_seq_len
    for start in range(0, n, batch_size):
        idx = range(start, min(start + batch_size, n))
        images = torch.stack([data[i][0] for i in idx])
        text, _ = tokenizer.tokenize([data[i][1] for i in idx], t)
        tokens = vae.get_codebook_indices(images)
        logits = dalle.logits(text, tokens)[:, t:, dalle.cfg.num_text_tokens :]
        total += F.cross_entropy(logits.transpose(1, 2), tokens, reduction="sum").item()
        count += tokens.numel()
    return total / count / math.log(2)


@torch.no_grad()
def evaluate_dalle(dalle_path: str, num_images: int, out: str, seed: int = 0, batch_size: int = 50, **sampling) -> dict:
    dalle, vae, tokenizer = load_dalle(dalle_path)
    result = {"bits_per_image_token": bits_per_image_token(dalle, vae, tokenizer), "sampling": sampling}
    g = torch.Generator().manual_seed(seed)
    for split, data_split in (("seen", "train"), ("heldout", "heldout")):
        data = ShapesDataset(num_images, vae.image_size, seed=VALIDATION_SEED + 1, split=data_split)
        captions = [data[i][1] for i in range(num_images)]
        scores, grid = [], []
        for start in range(0, num_images, batch_size):
            idx = list(range(start, min(start + batch_size, num_images)))
            text, _ = tokenizer.tokenize([captions[i] for i in idx], dalle.cfg.text_seq_len)
            images = vae.decode(generate_image_tokens(dalle, text, generator=g, **sampling))
            scores += [score(data.scene(i), parse_image(img)) for i, img in zip(idx, images)]
            grid.append(images)
        result[split] = summarize(scores)
        grid = torch.cat(grid)[:64]
        save_image(grid, os.path.join(out, f"generated_{split}.png"), nrow=8, padding=1)
        with open(os.path.join(out, f"generated_{split}.txt"), "w") as f:
            f.write(
                "\n".join(
                    f"{i:3d} {'ok ' if s['full'] else 'BAD'} {c}" for i, (c, s) in enumerate(zip(captions[:64], scores))
                )
                + "\n"
            )
    return result
