"""The main job on the built-in synthetic captioned dataset, end to end, on a CPU in about 15 minutes:
train the VAE, train DALLE on its tokens, train a CLIP to rerank its samples, generate images for a few
captions (the best 4 of 16 by CLIP), evaluate by parsing, with and without reranking.

    make demo            (or: .venv/bin/python scripts/demo.py [--out demo])
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import generate  # noqa: E402
import train_clip  # noqa: E402
import train_dalle  # noqa: E402
import train_vae  # noqa: E402
from dalle_pytorch.eval import evaluate  # noqa: E402

DALLE_BATCH = 32
CAPTIONS = (
    "a large red circle on the left|a small blue triangle above a large yellow square|a big green square in the center"
)


def dalle_recipe(vae_path: str, steps: int, common: list[str]) -> list[str]:
    """train_dalle.py's flags in the demo (scripts/demo_spread.py trains the same with other seeds)."""
    return [
        "--vae_path",
        vae_path,
        "--steps",
        str(steps),
        "--text_seq_len",
        "16",
        "--save_every_n_steps",
        "0",
        "--sample_every",
        "400",
        # a fresh sample for every step (the built-in data is free): repeating 20000 samples 3 times over the
        # same steps drew held-out colour-shape pairs worse (1000 held-out captions: 42% fully right, not 47%)
        "--dataset_size",
        str(steps * DALLE_BATCH),
        "--batch_size",
        str(DALLE_BATCH),
        # a narrower model than the default (dim 256) takes more steps in the CPU budget, which pays here
        "--dim",
        "192",
        "--dim_head",
        "48",
        *common,
    ]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="demo", help="folder for the runs, the images and the evaluation")
    p.add_argument("--vae_steps", type=int, default=1200)
    p.add_argument("--dalle_steps", type=int, default=2000)
    p.add_argument("--clip_steps", type=int, default=1500)
    p.add_argument("--eval_images", type=int, default=200, help="captions per split in the evaluation")
    p.add_argument("--candidates", type=int, default=16, help="samples per caption that CLIP reranks")
    args = p.parse_args(argv)
    t0 = time.time()
    common = ["--output_dir", os.path.join(args.out, "runs"), "--num_workers", "1", "--quiet", "--log_every", "100"]
    vae_path = train_vae.main(["--steps", str(args.vae_steps), "--save_every_n_steps", "0", *common])
    t1 = time.time()
    dalle_path = train_dalle.main(dalle_recipe(vae_path, args.dalle_steps, common))
    t2 = time.time()
    clip_path = train_clip.main(
        [
            "--dalle_path",
            dalle_path,
            "--steps",
            str(args.clip_steps),
            "--save_every_n_steps",
            "0",
            "--sample_every",
            "500",
            *common,
        ]
    )
    t3 = time.time()
    sampling = ["--temperature", "0.3"]  # sharper than the model's distribution: fewer malformed shapes
    folders = generate.main(
        [
            "--dalle_path",
            dalle_path,
            "--text",
            CAPTIONS,
            "--outputs_dir",
            os.path.join(args.out, "outputs"),
            "--clip_path",
            clip_path,
            "--num_images",
            "16",
            "--keep",
            "4",
            "--quiet",
            *sampling,
        ]
    )
    evaluate.main(
        [
            "--vae_path",
            vae_path,
            "--dalle_path",
            dalle_path,
            "--clip_path",
            clip_path,
            "--candidates",
            str(args.candidates),
            "--num_images",
            str(args.eval_images),
            "--out",
            os.path.join(args.out, "eval"),
            *sampling,
        ]
    )
    t4 = time.time()
    print(
        f"\ntimes: VAE {t1 - t0:.0f}s, DALLE {t2 - t1:.0f}s, CLIP {t3 - t2:.0f}s, "
        f"generation + evaluation {t4 - t3:.0f}s, total {t4 - t0:.0f}s"
    )
    print(f"runs:   {os.path.join(args.out, 'runs')}/ (vae/, dalle/, clip/: metrics.jsonl, samples/, train.log)")
    print("images: " + ", ".join(f + "/" for f in folders))
    print(
        f"eval:   {os.path.join(args.out, 'eval')}/ "
        "(results.json, results.txt, generated_seen.png, generated_heldout.png)"
    )


if __name__ == "__main__":
    main()
