"""Shards written sorted by a label: how mixed a streamed micro-batch is, and what it does to a CLIP.

    .venv/bin/python bench/stream_mix.py             # both parts (~10 min on 2 cores)
    .venv/bin/python bench/stream_mix.py --part mix  # the batch mixture alone (~1 min)

Part `mix`: 40 shards of 250 samples written sorted by a label (10 labels, 4 shards each: shards in source
order, as img2dataset keeps a URL list's order), streamed as a run streams them (WebDatasetPairs through
batches(): 1 rank x 2 DataLoader workers, micro-batch 16) at several --shuffle_block values; printed: the mean
over the epoch's micro-batches of the largest share of one label in a batch, and its ratio to uniform sampling
(the same statistic of batches drawn uniformly from the data, computed here).

Part `clip`: the built-in shapes (32x32) exported to 40 shards sorted by the colour named first in the caption,
and to 40 shards in random order; train_clip.py for --steps on each with --shuffle_block 1 (one shard at a time)
and with the default, 3 seeds each; printed: text -> image retrieval accuracy among groups of 32 held-out pairs
(mean and range), and the training time.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import statistics
import subprocess
import sys
import tarfile
import time
from types import SimpleNamespace

import common  # noqa: F401 - puts the repository on sys.path
import numpy as np
import torch
from PIL import Image

from dalle_pytorch.data.shapes import COLORS, sample
from dalle_pytorch.data.wds import SHUFFLE_BLOCK, StreamOptions, WebDatasetPairs
from dalle_pytorch.training.batches import Where, batches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_sorted(out: str, items, shards: int) -> list[str]:
    """`items`: (key, png bytes, caption), already in label order, cut into `shards` equal shards."""
    os.makedirs(out, exist_ok=True)
    per = len(items) // shards
    paths = []
    for s in range(shards):
        path = os.path.join(out, f"shard-{s:04d}.tar")
        with tarfile.open(path, "w") as tar:
            for key, png, caption in items[s * per : (s + 1) * per]:
                for name, data in ((f"{key}.png", png), (f"{key}.txt", caption.encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


def _png(color) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buf, format="PNG")
    return buf.getvalue()


def largest_share(labels: list[int], batch: int) -> float:
    return max(np.bincount(labels)) / batch


def mix(out: str, batch: int = 16, labels: int = 10, shards: int = 40, per_shard: int = 250) -> None:
    items = [(f"{k:06d}", _png((k % 256, 0, 0)), f"label {k * labels // (shards * per_shard)}")
             for k in range(shards * per_shard)]  # fmt: skip
    paths = write_sorted(os.path.join(out, "labels"), items, shards)
    rng = np.random.default_rng(0)
    all_labels = np.array([int(c.split()[1]) for _, _, c in items])
    uniform = statistics.mean(largest_share(rng.choice(all_labels, batch).tolist(), batch) for _ in range(20000))
    print(f"{shards} shards of {per_shard} sorted by {labels} labels, micro-batch {batch}, 1 rank x 2 workers")
    print(f"uniform sampling: largest label share {uniform:.3f}")
    print("shuffle_block  shards/block  largest share  x uniform  batches/s")
    for block in (1, 2 * per_shard, 4 * per_shard, 8 * per_shard, 16 * per_shard, SHUFFLE_BLOCK):
        ds = WebDatasetPairs(paths, "png,txt", 8, resize_ratio=1.0, seed=0, options=StreamOptions(shuffle_block=block))
        ds.count()
        cfg = SimpleNamespace(batch_size=batch, num_workers=2, seed=0)
        backend = SimpleNamespace(world_size=1, rank=0, device=torch.device("cpu"))
        run = batches(ds, cfg, backend, Where())
        steps = shards * per_shard // batch
        t = time.perf_counter()
        shares = [largest_share([int(c.split()[1]) for c in next(run)[0][1]], batch) for _ in range(steps)]
        rate = steps / (time.perf_counter() - t)
        share = statistics.mean(shares)
        per_block = max(block, per_shard) // per_shard if block < shards * per_shard else shards
        print(f"{block:>13}  {per_block:>12}  {share:>13.3f}  {share / uniform:>9.2f}  {rate:>9.0f}")


def shapes_shards(out: str, n: int, shards: int, sort: bool) -> list[str]:
    colours = list(COLORS)
    items = []
    for i in range(n):
        img, caption, _ = sample(0, i, 32)
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        items.append((f"{i:06d}", buf.getvalue(), caption))
    first = lambda caption: min((caption.find(c), c) for c in colours if c in caption)[1]  # noqa: E731
    if sort:
        items.sort(key=lambda it: (colours.index(first(it[2])), it[0]))
    return write_sorted(out, items, shards)


CLIP_MODEL = ["--image_size", "32", "--patch_size", "8", "--dim_text", "64", "--dim_image", "64", "--dim_latent",
              "64", "--text_depth", "2", "--image_depth", "2", "--heads", "2", "--text_seq_len", "32"]  # fmt: skip


@torch.no_grad()
def retrieval(export: str, n: int = 640, group: int = 32) -> float:
    from dalle_pytorch.inference.load import load_clip

    clip, tokenizer = load_clip(export)
    hits = 0
    for start in range(0, n, group):
        pairs = [sample(7, 100_000 + i, 32, "train") for i in range(start, start + group)]  # held out: other seed
        images = torch.stack([torch.from_numpy(np.asarray(img, dtype=np.float32) / 255).permute(2, 0, 1)
                              for img, _, _ in pairs])  # fmt: skip
        text, _ = tokenizer.tokenize([c for _, c, _ in pairs], clip.cfg.text_seq_len)
        best = (clip.embed_text(text) @ clip.embed_image(images).T).argmax(-1)
        hits += int((best == torch.arange(group)).sum())
    return hits / n


def clip(out: str, steps: int, seeds: int) -> None:
    print(f"\nCLIP on 8000 shapes in 40 shards, {steps} steps of 32, one thread, 2 workers")
    print("shards               shuffle_block  retrieval@32 mean (range)  train s")
    for order, block in (("sorted", 1), ("sorted", SHUFFLE_BLOCK), ("shuffled", 1), ("shuffled", SHUFFLE_BLOCK)):
        data = os.path.join(out, f"shapes-{order}")
        if not os.path.isdir(data):
            shapes_shards(data, 8000, 40, sort=order == "sorted")
        accs, secs = [], []
        for seed in range(seeds):
            run = os.path.join(out, f"clip-{order}-{block}-{seed}")
            cmd = [sys.executable, os.path.join(ROOT, "train_clip.py"), *CLIP_MODEL, "--wds", "png,txt",
                   "--image_text_folder", data, "--steps", str(steps), "--batch_size", "32", "--seed", str(seed),
                   "--shuffle_block", str(block), "--output_dir", run, "--threads", "1", "--quiet",
                   "--learning_rate", "1e-3", "--tokenizer", "byte"]  # fmt: skip
            t = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            secs.append(time.perf_counter() - t)
            accs.append(retrieval(os.path.join(run, "clip", "clip.safetensors")))
        shards = "by colour" if order == "sorted" else "in random order"
        print(f"{shards:<20} {block:>13}  {statistics.mean(accs):.3f} ({min(accs):.3f}-{max(accs):.3f})  "
              f"{statistics.mean(secs):7.0f}")  # fmt: skip


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/stream-mix")
    p.add_argument("--part", choices=("mix", "clip", "both"), default="both")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args(argv)
    random.seed(0)
    if args.part in ("mix", "both"):
        mix(args.out)
    if args.part in ("clip", "both"):
        clip(args.out, args.steps, args.seeds)


if __name__ == "__main__":
    main()
