"""How much the demo's figures move with the DALLE's seed, and whether --ema helps held-out captions.

The demo's VAE and CLIP are trained once; the DALLE is trained with the demo's recipe once per seed, with
--ema (which leaves the raw weights exactly as without it), and each DALLE is evaluated on 1000 captions
per split with its raw weights and with their moving average. Prints one row per seed and weights, then the
mean and range over the seeds, and writes spread.json.

    .venv/bin/python scripts/demo_spread.py [--seeds 42 1 2] [--ema 0.995] [--out demo_spread]

About 38 minutes per seed on a 2-core CPU (DALLE about 20, two evaluations about 10 each): 2 hours for the
default 3 seeds, the VAE and CLIP included (AMD EPYC, AVX2, 2026-12-06).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import demo  # noqa: E402

import train_clip  # noqa: E402
import train_dalle  # noqa: E402
import train_vae  # noqa: E402
from dalle_pytorch.eval import evaluate  # noqa: E402
from dalle_pytorch.inference.fits import dalle_fit  # noqa: E402

ROWS = (
    ("heldout plain", lambda r: r["heldout"]["full"]["mean"]),
    ("heldout reranked", lambda r: r["heldout_reranked"]["full"]["mean"]),
    ("heldout best possible", lambda r: r["reranking"]["heldout_best_possible"]),
    ("seen plain", lambda r: r["seen"]["full"]["mean"]),
    ("seen reranked", lambda r: r["seen_reranked"]["full"]["mean"]),
)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="demo_spread")
    p.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2], help="DALLE seeds (42: the demo's)")
    p.add_argument("--ema", type=float, default=0.995, help="the DALLE's --ema decay")
    p.add_argument("--vae_steps", type=int, default=1200)
    p.add_argument("--dalle_steps", type=int, default=2000)
    p.add_argument("--clip_steps", type=int, default=1500)
    p.add_argument("--eval_images", type=int, default=1000, help="captions per split")
    args = p.parse_args(argv)
    common = ["--output_dir", os.path.join(args.out, "runs"), "--num_workers", "1", "--quiet", "--log_every", "100"]
    vae = os.path.join(args.out, "runs", "vae", "vae.safetensors")
    if not os.path.exists(vae):
        vae = train_vae.main(["--steps", str(args.vae_steps), "--save_every_n_steps", "0", *common])
    results, bpe, clip, tokenizer = {}, [], "", None
    for seed in args.seeds:
        name = f"dalle-seed{seed}"
        t0 = time.time()
        dalle = os.path.join(args.out, "runs", name, "dalle.safetensors")
        if not os.path.exists(dalle):
            recipe = demo.dalle_recipe(vae, args.dalle_steps, common)
            # the first seed's BPE for all, so that one CLIP reads every DALLE's captions
            dalle = train_dalle.main([*recipe, "--seed", str(seed), "--name", name, "--ema", str(args.ema), *bpe])
        # the first seed's own BPE lowercases what it reads: the others read it the same way (--bpe_lowercase)
        bpe = bpe or ["--bpe_path", os.path.join(os.path.dirname(dalle), "bpe.yttm"), "--bpe_lowercase"]
        if tokenizer is None:  # the CLIP, trained once on the first seed's DALLE (its tokenizers, its VAE)
            tokenizer = dalle_fit(dalle)["tokenizer"]
            clip = os.path.join(args.out, "runs", "clip", "clip.safetensors")
            if not os.path.exists(clip):
                clip = train_clip.main(
                    ["--dalle_path", dalle, "--steps", str(args.clip_steps), "--save_every_n_steps", "0", *common]
                )
        elif dalle_fit(dalle)["tokenizer"] != tokenizer:
            raise SystemExit(f"{dalle} has another text tokenizer than the first seed's: one CLIP cannot rerank both")
        for weights in ("raw", "ema"):
            folder = os.path.join(args.out, "eval", f"{name}-{weights}")
            path = os.path.join(folder, "results.json")
            if not os.path.exists(path):
                evaluate.main(
                    ["--dalle_path", dalle, "--clip_path", clip, "--candidates", "16", "--num_images",
                     str(args.eval_images), "--temperature", "0.3", "--weights", weights, "--out", folder]
                )  # fmt: skip
            results[f"{seed}/{weights}"] = json.load(open(path))["dalle"]
        print(f"seed {seed}: {time.time() - t0:.0f}s", flush=True)
    lines = [f"{'':24}" + "".join(f"{f'{s}/{w}':>11}" for s in args.seeds for w in ("raw", "ema"))]
    summary = {}
    for label, read in ROWS:
        values = {k: read(r) for k, r in results.items()}
        lines.append(
            f"{label:24}" + "".join(f"{100 * values[f'{s}/{w}']:10.1f}%" for s in args.seeds for w in ("raw", "ema"))
        )
        for w in ("raw", "ema"):
            v = [values[f"{s}/{w}"] for s in args.seeds]
            summary[f"{label} {w}"] = {"mean": statistics.mean(v), "min": min(v), "max": max(v), "values": v}
    lines.append("")
    for key, s in summary.items():
        lines.append(f"{key:28} mean {100 * s['mean']:5.1f}%  range [{100 * s['min']:.1f}%, {100 * s['max']:.1f}%]")
    print("\n".join(lines))
    with open(os.path.join(args.out, "spread.json"), "w") as f:
        json.dump({"seeds": args.seeds, "ema": args.ema, "summary": summary, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
