"""The rates the evaluation reports: means with bootstrap 95% intervals, and the table it prints."""

from __future__ import annotations

import random

from .parse import ATTRIBUTES

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


def table(results: dict) -> str:
    """A short human-readable table of `results` from evaluate_vae / evaluate_dalle, or on your data."""
    if "fid" in results.get("dalle", {}) or "num_images" in results.get("vae", {}) and "parse" not in results["vae"]:
        return data_table(results)
    lines = []
    if "vae" in results:
        v = results["vae"]
        lines.append(
            f"VAE   PSNR {v['psnr']:.2f} dB | reconstructions parsed correctly {v['parse']['full']['mean']:.1%} "
            f"| codebook usage {v['codebook_usage']:.1%} (perplexity {v['codebook_perplexity']:.1f})"
        )
        if "rfid" in v:  # --fid
            lines.append(_row(f"VAE, {v['num_images']} images", v))
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
        for split in splits:
            if "fid" in d[split]:  # --fid
                lines.append(_row(f"{split}, {d[split]['num_images']} images", d[split]))
    return "\n".join(lines)


def data_table(results: dict) -> str:
    """The figures on your data (on_data.py), one row per set of images scored."""

    row = _row
    lines = []
    if "dalle" in results:
        d = results["dalle"]
        lines.append(row(f"DALLE, {d['num_images']} captions", d))
        if "reranked" in d:
            lines.append(row(f"  best of {d['reranked']['candidates']} by CLIP", d["reranked"]))
    if "vae" in results:
        v = results["vae"]
        lines.append(row(f"tokenizer, {v['num_images']} images", v))
    return "\n".join(lines)


def _row(name: str, r: dict) -> str:
    cells = [f"{k} {_figure(r, k)}" for k in FIGURES if k in r]
    return f"{name:<34} " + " | ".join(cells)


# the figures in the order a reader looks for them; a std beside its mean
FIGURES = ("fid", "rfid", "kid", "rkid", "inception_score", "precision", "recall", "clip_score", "psnr", "ssim",
           "codebook_usage", "codebook_perplexity")  # fmt: skip


def _figure(r: dict, k: str) -> str:
    std = r.get(f"{k}_std")
    value = f"{r[k]:.4g}" + (f" ± {std:.2g}" if std is not None else "")
    return value + (" dB" if k == "psnr" else "")
