"""dVAE against VQGAN at equal wall time: each tokenizer trains for --seconds on the same data (its steps come from
its own speed, timed over a short first run), then its reconstructions are scored on held-out images (PSNR,
rFID and friends, codebook usage; on the built-in data also the parser's accuracy on reconstructions); with
--dalle_seconds a DALLE (the demo's recipe) trains on each for that long, and the built-in data's evaluation reads
its images back (held-out and seen rates) and scores them (FID).

    .venv/bin/python bench/tokenizers.py [--data builtin,digits] [--seconds 120] [--dalle_seconds 0]
        [--inception_weights F --vgg16_weights F] [--perceptual_weights F]

The dVAE: train_vae.py's defaults (the demo's). The VQGAN: the same shared flags (--num_tokens, --num_layers,
--hidden_dim 32), its code dimension 8, a discriminator of 32 channels and 2 layers from half the run, and LPIPS only
with --perceptual_weights (its VGG-16; this machine has none, and random VGG features are no perceptual loss).
digits: coloured handwritten digits (../shared/bench/binding.py make, 32 x 32): 2800 to train on, 200 held out.
Without weights files the Inception and VGG-16 have fixed random values (bench/fid.py's): rFIDs then rank the
tokenizers against each other, and are not comparable with published figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from fid import BINDING, random_weights, split  # noqa: E402

VQGAN = ["--model", "vqgan", "--hidden_dim", "32", "--disc_hidden_dim", "32", "--disc_layers", "2"]


def seconds_per_step(run: str) -> float:
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    return statistics.median(r["seconds_per_step"] for r in rows[1:] or rows)


def train_for(script, flags: list[str], seconds: float, out: str, name: str) -> tuple[str, int, float]:
    """(export, steps, seconds taken): a 12-step run times a step, then the run of `seconds`."""
    common = ["--output_dir", out, "--num_workers", "1", "--quiet", "--save_every_n_steps", "0", "--sample_every", "0"]
    script.main([*flags, *common, "--name", f"{name}-probe", "--steps", "12", "--log_every", "2"])
    steps = max(int(seconds / seconds_per_step(os.path.join(out, f"{name}-probe"))), 1)
    t0 = time.perf_counter()
    export = script.main([*flags, *common, "--name", name, "--steps", str(steps), "--log_every", "50"])
    return export, steps, time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/tokenizer-bench")
    p.add_argument("--data", default="builtin,digits")
    p.add_argument("--seconds", type=float, default=120, help="training time of each tokenizer")
    p.add_argument("--dalle_seconds", type=float, default=0, help="training time of the DALLE on each (0: none)")
    p.add_argument("--images", type=int, default=200, help="held-out images scored")
    p.add_argument("--inception_weights", default="")
    p.add_argument("--vgg16_weights", default="")
    p.add_argument("--perceptual_weights", default="")
    args = p.parse_args(argv)
    import torch
    from demo import dalle_recipe

    import train_dalle
    import train_vae
    from dalle_pytorch.eval import evaluate

    torch.set_num_threads(os.cpu_count())
    os.makedirs(args.out, exist_ok=True)
    weights = [args.inception_weights, args.vgg16_weights]
    random = not all(weights)
    if random:
        weights = random_weights(args.out)
    scoring = ["--inception_weights", weights[0], "--vgg16_weights", weights[1], "--num_images", str(args.images)]
    perceptual = ["--perceptual_weights", args.perceptual_weights] if args.perceptual_weights else []
    vqgan = [*VQGAN, *(perceptual or ["--perceptual_weight", "0"])]
    rows = []
    for data in args.data.split(","):
        data_flags, val = [], []
        if data == "digits":
            folder = os.path.join(args.out, "digits")
            if not os.path.isdir(os.path.join(folder, "train")):
                subprocess.run([sys.executable, BINDING, "make", folder], check=True)
            fit, held = split(folder, args.images)
            data_flags, val = ["--image_folder", fit], ["--image_text_folder", held]
        for model, flags in (("dvae", []), ("vqgan", vqgan)):
            name = f"{data}-{model}"
            export, steps, took = train_for(train_vae, [*flags, *data_flags], args.seconds, args.out, name)
            out = os.path.join(args.out, f"eval-{name}")
            fid = [] if val else ["--fid"]
            v = evaluate.main(["--vae_path", export, *val, *fid, *scoring, "--out", out])["vae"]
            row = {"data": data, "tokenizer": model, "steps": steps, "seconds": took, **v}
            if args.dalle_seconds and data == "builtin":
                recipe = dalle_recipe(export, 100_000, [])  # its --steps: train_for's; a fresh sample per step
                dalle, dsteps, _ = train_for(train_dalle, recipe, args.dalle_seconds, args.out, f"{name}-dalle")
                d = evaluate.main(["--dalle_path", dalle, "--fid", *scoring, "--temperature", "0.3",
                                   "--out", out + "-dalle"])["dalle"]  # fmt: skip
                row.update(dalle_steps=dsteps, heldout=d["heldout"]["full"]["mean"], seen=d["seen"]["full"]["mean"])
                row.update(dalle_fid=d["seen"]["fid"])
            rows.append(row)
            print(json.dumps({k: row[k] for k in row if not isinstance(row[k], dict)}), flush=True)
    kind = "fixed random" if random else "the given"
    print(f"\ntokenizers at {args.seconds:.0f} s of training each, 2-core CPU; {kind} Inception/VGG-16 weights; "
          f"LPIPS {'on' if perceptual else 'off'}")  # fmt: skip
    head = f"{'data':8} {'tokenizer':9} {'steps':>6} {'PSNR':>6} {'rFID':>8} {'usage':>6} {'perplex':>8}"
    print(head + (f" {'parsed':>7}" if "builtin" in args.data else "") + (
        f" {'DALLE steps':>11} {'held-out':>8} {'seen':>6} {'FID':>7}" if args.dalle_seconds else ""))  # fmt: skip
    for r in rows:
        line = f"{r['data']:8} {r['tokenizer']:9} {r['steps']:>6} {r['psnr']:>6.2f} {r['rfid']:>8.3f} "
        line += f"{r['codebook_usage']:>6.1%} {r['codebook_perplexity']:>8.1f}"
        if "builtin" in args.data:
            line += f" {r['parse']['full']['mean']:>7.1%}" if "parse" in r else f" {'':>7}"
        if "heldout" in r:
            line += f" {r['dalle_steps']:>11} {r['heldout']:>8.1%} {r['seen']:>6.1%} {r['dalle_fid']:>7.3f}"
        print(line)


if __name__ == "__main__":
    main()
