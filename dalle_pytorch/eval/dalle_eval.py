"""DALLE on the built-in dataset: bits per image token on validation pairs, and generated images read
back by the parser, on seen colour-shape combinations and on held-out ones."""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torchvision.utils import save_image

from ..data.shapes import ShapesDataset
from ..inference.load import load_dalle
from ..inference.pipeline import RerankConfig, SamplingConfig, best_of, candidate_images, load_reranker
from .fidelity import settings
from .on_data import describe_clip, score_sets
from .parse import parse_image, score
from .summary import VALIDATION_SEED, summarize


@torch.no_grad()
def bits_per_image_token(dalle, vae, tokenizer, n: int = 256, batch_size: int = 64) -> float:
    data = ShapesDataset(n, vae.image_size, seed=VALIDATION_SEED, split="train")
    total, count = 0.0, 0
    t = dalle.cfg.text_seq_len
    for start in range(0, n, batch_size):
        idx = range(start, min(start + batch_size, n))
        images = torch.stack([data[i][0] for i in idx])
        text, _ = tokenizer.captions([data[i][1] for i in idx], t)
        tokens = vae.get_codebook_indices(images)
        logits = dalle.logits(text, tokens)[:, t:, dalle.cfg.num_text_tokens :]
        total += F.cross_entropy(logits.transpose(1, 2), tokens, reduction="sum").item()
        count += tokens.numel()
    return total / count / math.log(2)


@torch.no_grad()
def evaluate_dalle(
    dalle_path: str,
    num_images: int,
    out: str,
    sampling: SamplingConfig,
    rerank: RerankConfig,
    candidates: int = 16,
    seed: int = 0,
    batch_size: int = 64,
    fidelity=None,
) -> dict:
    """Generated images parsed against their captions, `num_images` captions per split. With a CLIP
    (`rerank.clip_path`), each caption gets `candidates` samples: the plain rate is over all of them, the
    reranked one over the `rerank.keep` that CLIP scores highest (DALL-E's reranking), and the fraction of
    captions with at least one fully right candidate (results.json, reranking.SPLIT_best_possible).
    With `fidelity` (a FidelityConfig), each split's first sample per caption (and CLIP's best) also gets FID and
    its friends against the dataset's own images for the same captions: out/SPLIT/{reference,generated[_reranked]}."""
    dalle, vae, tokenizer = load_dalle(
        dalle_path, weights=sampling.weights, text_encoder_path=sampling.text_encoder_path
    )
    clip, keep = None, rerank.keep
    if rerank.clip_path:
        clip, clip_tokenizer = load_reranker(rerank.clip_path, dalle_path, dalle, vae, tokenizer)
        if not 1 <= keep <= candidates:
            raise ValueError(f"--keep must be between 1 and --candidates {candidates} (got {keep})")
    options = sampling.token_options(dalle)
    per_caption = candidates if clip else 1
    result = {"bits_per_image_token": bits_per_image_token(dalle, vae, tokenizer), "sampling": options}
    if fidelity is not None:
        result["fidelity"] = settings(fidelity)
    if clip:
        result["reranking"] = {"candidates": candidates, "keep": keep}
        result["clip_retrieval"] = clip_retrieval(clip, clip_tokenizer, vae.image_size)
        result["clip"] = describe_clip(clip, rerank.clip_path)
    g = torch.Generator().manual_seed(seed)
    captions_per_batch = max(batch_size // per_caption, 1)
    for split, data_split in (("seen", "train"), ("heldout", "heldout")):
        data = ShapesDataset(num_images, vae.image_size, seed=VALIDATION_SEED + 1, split=data_split)
        captions = [data[i][1] for i in range(num_images)]
        plain, reranked, grid, any_right = [], [], [], []
        firsts, bests = [], []  # one image per caption: the first sample, CLIP's best
        for start in range(0, num_images, captions_per_batch):
            idx = list(range(start, min(start + captions_per_batch, num_images)))
            text, _ = tokenizer.captions([captions[i] for i in idx], dalle.cfg.text_seq_len)
            rows = text.repeat_interleave(per_caption, 0)
            images = candidate_images(dalle, vae, rows, len(rows), g, **options)
            images = images.view(len(idx), per_caption, *images.shape[1:])  # (captions, samples, c, s, s)
            for i, group in zip(idx, images):
                firsts.append(group[:1])
                scores = [score(data.scene(i), parse_image(img)) for img in group]
                plain += scores
                if clip:
                    best, _ = best_of(clip, clip_tokenizer, captions[i], group, keep)
                    reranked += [scores[j] for j in best.tolist()]
                    any_right.append(any(s["full"] for s in scores))
                    group = group[best]
                    bests.append(group[:1])
                grid.append(group[:1])
        result[split] = summarize(plain)
        if clip:
            result[f"{split}_reranked"] = summarize(reranked)
            # the rate a perfect reranker would reach (keep 1): below it the reranker loses, above the generator
            result["reranking"][f"{split}_best_possible"] = sum(any_right) / len(any_right)
        if fidelity is not None:
            sets = {"generated": torch.cat(firsts)} | ({"generated_reranked": torch.cat(bests)} if clip else {})
            reference = torch.stack([data[i][0] for i in range(num_images)])
            found = score_sets(os.path.join(out, split), reference, fidelity, **sets)
            result[split].update(found["generated"], num_images=num_images)
            if clip:
                result[f"{split}_reranked"].update(found["generated_reranked"], num_images=num_images)
        grid = torch.cat(grid)[:64]
        save_image(grid, os.path.join(out, f"generated_{split}.png"), nrow=8, padding=1)
        shown = reranked[::keep] if clip else plain
        with open(os.path.join(out, f"generated_{split}.txt"), "w") as f:
            f.write(
                "\n".join(
                    f"{i:3d} {'ok ' if s['full'] else 'BAD'} {c}" for i, (c, s) in enumerate(zip(captions[:64], shown))
                )
                + "\n"
            )
    return result


@torch.no_grad()
def clip_retrieval(clip, tokenizer, image_size: int, n: int = 256, group: int = 32) -> dict:
    """CLIP's text -> image retrieval on held-out validation pairs (colour-shape combinations it never saw):
    the fraction of captions whose own image scores highest among `group` pairs, over n pairs."""
    data = ShapesDataset(n, image_size, seed=VALIDATION_SEED + 2, split="heldout")
    hits = 0
    for start in range(0, n, group):
        idx = range(start, min(start + group, n))
        text, _ = tokenizer.tokenize([data[i][1] for i in idx], clip.cfg.text_seq_len)
        images = torch.stack([data[i][0] for i in idx])
        sims = clip.embed_text(text) @ clip.embed_image(images).T
        hits += (sims.argmax(-1) == torch.arange(len(idx))).sum().item()
    return {"top1": hits / n, "group": group, "n": n}
