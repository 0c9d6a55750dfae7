"""Honest image-quality numbers on the built-in dataset, read back from pixels by `parse.py`.

    python -m dalle_pytorch.eval --vae_path vae.pt [--dalle_path dalle.pt [--clip_path clip.pt]] [--out DIR]

VAE: PSNR and the parser's accuracy on reconstructions (the ceiling for any generator), codebook usage.
DALLE: bits per image token on validation data, and the fraction of generated images whose parsed objects
match the caption, fully and per attribute, on seen captions and on held-out colour-shape combinations,
with bootstrap 95% confidence intervals, plus a grid of generated images beside their captions. With a
CLIP: the same rates after CLIP keeps the best of several samples per caption, and CLIP's own retrieval
accuracy on held-out validation pairs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random

import torch

from ..data.shapes import ShapesDataset
from ..models.vae import codebook_stats
from .parse import ATTRIBUTES, parse_image, score

VALIDATION_SEED = 10_007  # a different seed from training data: different scenes and captions


def bootstrap_ci(values: list[bool | float], n: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean."""
    if not values:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    k = len(values)
    means = sorted(sum(values[rng.randrange(k)] for _ in range(k)) / k for _ in range(n))
    return (means[int(0.025 * n)], means[int(0.975 * n) - 1])


def summarize(scores: list[dict]) -> dict:
    out = {"n": len(scores)}
    for key in ("full", *ATTRIBUTES):
        vals = [float(s[key]) for s in scores]
        lo, hi = bootstrap_ci(vals)
        out[key] = {"mean": sum(vals) / max(len(vals), 1), "ci95": [lo, hi]}
    return out


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


def table(results: dict) -> str:
    """A short human-readable table of `results` from evaluate_vae / evaluate_dalle."""
    lines = []
    if "vae" in results:
        v = results["vae"]
        lines.append(
            f"VAE   PSNR {v['psnr']:.2f} dB | reconstructions parsed correctly {v['parse']['full']['mean']:.1%} "
            f"| codebook usage {v['codebook_usage']:.1%} (perplexity {v['codebook_perplexity']:.1f})"
        )
    if "dalle" in results:
        d = results["dalle"]
        lines.append(f"DALLE bits per image token (validation) {d['bits_per_image_token']:.3f}")
        if "clip_retrieval" in d:
            r, k = d["clip_retrieval"], d["reranking"]
            lines.append(
                f"CLIP  text -> image retrieval on held-out pairs {r['top1']:.1%} (top 1 of {r['group']}); "
                f"reranked rows keep the best {k['keep']} of {k['candidates']} samples per caption"
            )
        lines.append(f"{'split':16} {'n':>5} " + " ".join(f"{k:>15}" for k in ("full", *ATTRIBUTES)))
        splits = [s for s in ("seen", "heldout", "seen_reranked", "heldout_reranked") if s in d]
        for split in splits:
            s = d[split]
            cells = " ".join(
                f"{s[k]['mean']:>6.1%} [{s[k]['ci95'][0]:.0%},{s[k]['ci95'][1]:.0%}]".rjust(15)
                for k in ("full", *ATTRIBUTES)
            )
            lines.append(f"{split:16} {s['n']:>5} {cells}")
    return "\n".join(lines)


def main(argv=None):
    from ..training.export import load_vae

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vae_path", default="", help="VAE export (default: the one recorded in --dalle_path)")
    p.add_argument("--dalle_path", default="", help="DALLE export to evaluate by generation")
    p.add_argument("--num_images", type=int, default=200, help="generated images per split")
    p.add_argument("--cond_scale", type=float, default=1.0, help="classifier-free guidance scale")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--top_k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--clip_path", default="", help="a CLIP export: also report the rates after reranking")
    p.add_argument("--candidates", type=int, default=16, help="with --clip_path: samples per caption")
    p.add_argument("--keep", type=int, default=1, help="with --clip_path: the best samples kept per caption")
    p.add_argument("--out", default="eval", help="folder for results.json, results.txt and the grids")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results = {}
    if args.vae_path:
        results["vae"] = evaluate_vae(load_vae(args.vae_path)[0])
    if args.dalle_path:
        from .dalle_eval import evaluate_dalle

        results["dalle"] = evaluate_dalle(
            args.dalle_path,
            args.num_images,
            args.out,
            args.seed,
            clip_path=args.clip_path,
            candidates=args.candidates,
            keep=args.keep,
            cond_scale=args.cond_scale,
            temperature=args.temperature,
            top_k=args.top_k,
        )
    if not results:
        p.error("give --vae_path and/or --dalle_path")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    text = table(results)
    with open(os.path.join(args.out, "results.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    print(f"results: {os.path.join(args.out, 'results.json')}")
    return results


if __name__ == "__main__":
    main()
