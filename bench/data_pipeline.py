"""DALLE's training step fed on the fly (JPEG shards: decode, crop, caption tokens, the VAE on the batch) against
pre-encoded token shards (`codes.npy,txt`), at the demo's shape and at OpenAI's dVAE shape, in one run.

    .venv/bin/python bench/data_pipeline.py           # batch 8 at both shapes: about 3 minutes (+3 to encode once)
    .venv/bin/python bench/data_pipeline.py --quick   # fewer steps, batch 2 at 256 px: under a minute

Both paths run what training runs: WebDatasetPairs wrapped in data.tokenized, training.batches.batches (the
DataLoader), DALLETask.prepare_batch (the VAE's get_codebook_indices on a batch of images; codes pass through),
then forward + backward + AdamW in fp32. The token shards come from training.encode.encode_shards over the same
JPEG shards. Shards and token shards are made once under --data and reused (the token shards are keyed by the
VAE's fingerprint: its random weights are seeded, so the same on this machine). The two paths take turns (step
by step with num_workers 0, in blocks with 2 workers) and medians are printed, so that a slow spell of this
shared machine falls on both and moves neither much. Then one DataLoader worker's images/s (the dataset's own
__iter__ on one thread) beside the images/s the step alone takes, and the workers needed to keep up.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
import webdataset
from common import one_worker_rate  # common puts the repository on sys.path
from PIL import Image
from stream_resume import NOISE, cpu_model, quiet

from dalle_pytorch.data.shapes import sample
from dalle_pytorch.data.shards import open_shard
from dalle_pytorch.data.tokenized import tokenized
from dalle_pytorch.data.tokenizer import YttmTokenizer
from dalle_pytorch.data.wds import WebDatasetPairs
from dalle_pytorch.files import fingerprint
from dalle_pytorch.models.dalle import DALLE, DALLEConfig
from dalle_pytorch.models.openai_dvae import OpenAIDiscreteVAE, OpenAIDVAEConfig
from dalle_pytorch.models.vae import DiscreteVAE, VAEConfig
from dalle_pytorch.training.batches import Where, batches
from dalle_pytorch.training.dalle_task import DALLETask
from dalle_pytorch.training.encode import encode_shards
from dalle_pytorch.training.loop import param_groups

CPU = torch.device("cpu")


@dataclass
class Shape:
    name: str
    image_size: int
    samples: int  # JPEG shards made (and all encoded)
    per_shard: int
    batch: int
    dalle: dict  # DALLEConfig's shape flags


def shapes(quick: bool) -> list[Shape]:
    # scripts/demo.py: train_vae.py's defaults (VAEConfig: 32 px, 64 codes, 2 downsamplings: 8x8 tokens) and
    # dalle_recipe's flags (dim 192, dim_head 48, text 16; depth and heads the defaults); its batch is 32
    demo = Shape("demo", 32, 512, 64, 8, dict(dim=192, depth=4, heads=4, dim_head=48, text_seq_len=16))
    # OpenAI's dVAE (8192 codes, 256 px -> 32x32) encodes at ~270 GFLOP per image: a few dozen images suffice
    dvae = Shape("dvae", 256, 8 if quick else 32, 4 if quick else 16, 2 if quick else 8,
                 dict(dim=256, depth=2, heads=4, dim_head=64, text_seq_len=32))  # fmt: skip
    return [demo, dvae]


def build_vae(shape: Shape):
    """(VAE, its fingerprint, what it is) with random weights, the same every run (the token shards' cache key)."""
    torch.manual_seed(0)
    if shape.name == "demo":
        vae = DiscreteVAE(VAEConfig())
        config, what = vae.cfg.to_dict(), "our DiscreteVAE at train_vae.py's defaults"
    else:  # built without a download: the architecture is ours (models/openai_dvae.py), only the weights are OpenAI's
        vae = OpenAIDiscreteVAE(OpenAIDVAEConfig(), image_size=256)
        config = {**vae.cfg.to_dict(), "image_size": 256}
        what = "OpenAI's dVAE (models/openai_dvae.py: its encoder and decoder), random weights"
    return vae.eval(), fingerprint(config, vae.state_dict()), what


# ------------------------------------------------------------------------------------------ the shards


def _jpeg(i: int, size: int) -> tuple[bytes, str]:
    img, caption, _ = sample(0, i, size)
    noise = np.random.default_rng(i).normal(0.0, NOISE, (size, size, 3))  # photo-sized JPEGs, as stream_resume.py
    pixels = (np.asarray(img, dtype=np.float32) + noise).clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    return buf.getvalue(), caption


def jpeg_shards(root: str, shape: Shape) -> tuple[list[str], str]:
    """(shard paths, index) of shape's JPEG shards under root (made once)."""
    folder = os.path.join(root, f"{shape.image_size}px-{shape.samples}x{shape.per_shard}")
    urls = [os.path.join(folder, f"{s:05d}.tar") for s in range(shape.samples // shape.per_shard)]
    os.makedirs(folder, exist_ok=True)
    for s, url in enumerate(urls):
        if os.path.exists(url):
            continue
        with webdataset.TarWriter(f"{url}.tmp") as tar:
            for i in range(s * shape.per_shard, (s + 1) * shape.per_shard):
                jpg, caption = _jpeg(i, shape.image_size)
                tar.write({"__key__": f"{i:08d}", "jpg": jpg, "txt": caption})
        os.replace(f"{url}.tmp", url)
    return urls, os.path.join(folder, "shards.json")


def token_shards(root: str, shape: Shape, urls: list[str], vae, vae_id: str) -> tuple[str, str]:
    """(folder, one line) of the token shards of `urls`, encoded by encode_shards once per VAE fingerprint."""
    out = os.path.join(root, f"tokens-{shape.image_size}px-{shape.samples}x{shape.per_shard}-{vae_id}")
    t = time.perf_counter()
    n = encode_shards(urls, "jpg,txt", vae, vae_id, out, 0, 1, batch_size=shape.batch, say=quiet)
    dt = time.perf_counter() - t
    done = n * shape.per_shard
    said = f"encoded now, {done} images in {dt:.1f} s ({done / dt:.1f} images/s)" if n else "reused"
    return out, f"{said}: {out}"


def mean_image_bytes(url: str) -> float:
    shard = open_shard(url)
    try:
        return statistics.fmean(len(shard.read(j)["jpg"]) for j in range(len(shard)))
    finally:
        shard.close()


def pairs(urls, keys: str, index: str, shape: Shape, tokenizer, seed: int):
    dataset = WebDatasetPairs(urls, keys, shape.image_size, seed=seed)
    dataset.count(index, say=quiet)
    return tokenized(dataset, tokenizer, shape.dalle["text_seq_len"])


# ------------------------------------------------------------------------------------------ the step


class Stream:
    """One path's batches -> prepare_batch -> step, each step's (data, VAE, model) seconds recorded."""

    def __init__(self, dataset, task, opt, batch: int, workers: int, seed: int):
        cfg = SimpleNamespace(batch_size=batch, num_workers=workers, seed=seed)
        backend = SimpleNamespace(world_size=1, rank=0, device=CPU)
        self.batches = batches(dataset, cfg, backend, Where(), say=quiet)
        self.task, self.opt = task, opt
        self.times: list[tuple[float, float, float]] = []

    def step(self, keep: bool = True) -> None:
        t0 = time.perf_counter()
        batch, _ = next(self.batches)
        t1 = time.perf_counter()
        batch = self.task.prepare_batch(batch, CPU)
        t2 = time.perf_counter()
        loss, _ = self.task.loss(self.task.model, batch, 0)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if keep:
            self.times.append((t1 - t0, t2 - t1, t3 - t2))

    def medians(self) -> tuple[float, float, float, float]:
        """(data, VAE, model, whole step) seconds: medians over the kept steps (a slow spell of the shared
        machine moves a mean, hardly a median)."""
        whole = [sum(t) for t in self.times]
        return (*(statistics.median(t[k] for t in self.times) for k in range(3)), statistics.median(whole))

    def close(self) -> None:
        self.batches.close()  # the DataLoader's workers stop here


def line(label: str, times: tuple[float, float, float, float], batch: int) -> str:
    data, vae, model, total = times
    parts = f"data {data * 1e3:7.1f} ms ({data / total:3.0%})"
    if vae > 1e-3:
        parts += f", VAE {vae * 1e3:7.1f} ms ({vae / total:3.0%})"
    return (
        f"    {label:<12}: step {total * 1e3:8.1f} ms: {parts}, model {model * 1e3:7.1f} ms "
        f"({model / total:4.0%}); {batch / total:6.1f} images/s"
    )


def compare(shape: Shape, onfly, encoded, task, opt, workers: int, warmup: int, steps: int, seed: int):
    """Median (data, VAE, model, step) seconds of the two paths, both streams open and taking turns: step by
    step without workers; with workers in blocks of up to 10 steps, so that each block's batches are mostly
    decoded during that block (a path's workers stop once they have prefetched 2 batches each)."""
    streams = [Stream(onfly(), task, opt, shape.batch, workers, seed),
               Stream(encoded(), task, opt, shape.batch, workers, seed)]  # fmt: skip
    block = 1 if workers == 0 else min(steps, 10)
    for s in streams:
        for _ in range(warmup):
            s.step(keep=False)
    done = 0
    while done < steps:
        n = min(block, steps - done)
        for s in streams:
            for _ in range(n):
                s.step()
        done += n
    for s in streams:
        s.close()
    return [s.medians() for s in streams]


# ------------------------------------------------------------------------------------------ one worker


def worker_rate(dataset, n: int) -> float:
    """Images/s of the dataset's own __iter__ on one thread, as a DataLoader worker runs it (epochs repeated
    until n items; the first item, with first-use costs, left out)."""

    def forever():
        while True:
            yield from dataset

    return one_worker_rate(forever(), n)


def caption_seconds(tokenizer, captions: list[str], text_seq_len: int) -> float:
    """Seconds to tokenize one caption as tokenized() does it, alone."""
    t = time.perf_counter()
    for c in captions:
        tokenizer.tokenize(c, text_seq_len)
    return (time.perf_counter() - t) / len(captions)


@contextlib.contextmanager
def silenced():
    """stdout and stderr at the file descriptors: YouTokenToMe's training prints from C++."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="/tmp/dalle-bench-shards", help="folder for the shards (made once, reused)")
    p.add_argument("--quick", action="store_true", help="fewer steps and decodes; batch 2 at 256 px")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the training process")
    args = p.parse_args(argv)
    seed = 42
    # (warmup, timed) steps per path: at 256 px an on-the-fly step is the VAE's ~270 GFLOP per image
    steps = {"demo": (2, 6), "dvae": (1, 1)} if args.quick else {"demo": (3, 30), "dvae": (1, 2)}
    rate_n = 100 if args.quick else 400
    torch.set_num_threads(args.threads)

    print(f"cpu: {cpu_model()}, {os.cpu_count()} cores; torch threads {args.threads}, fp32")
    all_shapes = shapes(args.quick)
    jpegs = {s.name: jpeg_shards(args.data, s) for s in all_shapes}
    captions = WebDatasetPairs(jpegs["demo"][0], "jpg,txt", 32).captions(10_000)
    with tempfile.TemporaryDirectory() as tmp, silenced():  # train_dalle.py's default: a BPE of 256 on the captions
        tokenizer = YttmTokenizer.train(captions, 256, os.path.join(tmp, "bpe.yttm"))
    print(f"text tokenizer: YouTokenToMe BPE, vocabulary {tokenizer.vocab_size}, trained on {len(captions)} captions")

    consumption, loaders = {}, {}
    for shape in all_shapes:
        urls, index = jpegs[shape.name]
        vae, vae_id, vae_what = build_vae(shape)
        token_dir, encoded_line = token_shards(args.data, shape, urls, vae, vae_id)
        cfg = DALLEConfig(**shape.dalle, num_text_tokens=tokenizer.vocab_size, num_image_tokens=vae.num_tokens,
                          image_fmap_size=vae.fmap_size)  # fmt: skip
        torch.manual_seed(seed)
        dalle = DALLE(cfg)
        opt = torch.optim.AdamW(param_groups(dalle, 0.01), lr=1e-4, foreach=True)
        task = DALLETask(dalle, vae, {}, tokenizer, None, "", [])
        n_params = sum(p.numel() for p in dalle.parameters())
        mean_jpeg = mean_image_bytes(urls[0])
        print(f"\nshape {shape.name}: {shape.image_size} px images as {vae.fmap_size}x{vae.fmap_size} tokens of "
              f"{vae.num_tokens} codes; {vae_what}, {sum(p.numel() for p in vae.parameters()) / 1e6:.2f}M "
              f"parameters")  # fmt: skip
        print(
            f"  DALLE dim {cfg.dim}, depth {cfg.depth}, heads {cfg.heads}, dim_head {cfg.dim_head}, sequence "
            f"{cfg.seq_len} (text {cfg.text_seq_len} + image {cfg.image_seq_len}), {n_params / 1e6:.2f}M parameters, "
            f"batch {shape.batch}"
        )
        print(
            f"  data: {shape.samples} JPEGs q90 (mean {mean_jpeg / 1024:.1f} KiB) + .txt captions in "
            f"{len(urls)} shards of {shape.per_shard}, {os.path.dirname(index)}"
        )
        print(f"  token shards (encode_shards, batch {shape.batch}): {encoded_line}")

        def onfly(urls=urls, index=index, shape=shape):
            return pairs(urls, "jpg,txt", index, shape, tokenizer, seed)

        def encoded(token_dir=token_dir, shape=shape):
            return pairs(token_dir, "codes.npy,txt", os.path.join(token_dir, "shards.json"), shape, tokenizer, seed)

        warmup, timed = steps[shape.name]
        for workers in (0, 2):
            how = "step by step" if workers == 0 else f"in blocks of up to {min(timed, 10)} steps"
            print(
                f"  num_workers {workers} (the paths take turns {how}; {warmup} warm-up + {timed} timed steps "
                "each, medians):"
            )
            fly, enc = compare(shape, onfly, encoded, task, opt, workers, warmup, timed, seed)
            print(line("on the fly", fly, shape.batch))
            print(line("pre-encoded", enc, shape.batch))
            print(
                f"    on the fly / pre-encoded: {fly[3] / enc[3]:.2f}x the step time; data + VAE "
                f"{(fly[0] + fly[1]) / fly[3]:.0%} of the on-the-fly step"
            )
            if workers == 0:
                consumption[shape.name] = shape.batch / enc[2]
        loaders[shape.name] = {
            "jpg": worker_rate(onfly(), rate_n),
            "captions": caption_seconds(tokenizer, captions, shape.dalle["text_seq_len"]),
            "codes": worker_rate(encoded(), rate_n),
        }

    print(
        "\none DataLoader worker (the dataset's own __iter__, 1 thread: WebDatasetPairs + tokenized) against the "
        "training step alone (pre-encoded, num_workers 0, model time only):"
    )
    for shape in all_shapes:
        r, need = loaders[shape.name], consumption[shape.name]
        print(
            f"  {shape.name} ({shape.image_size} px, batch {shape.batch}): the step takes {need:7.1f} images/s; "
            f"a worker gives JPEG {r['jpg']:6.0f} images/s ({1e3 / r['jpg']:.2f} ms each, of which caption tokens "
            f"{r['captions'] * 1e3:.2f} ms), codes.npy {r['codes']:6.0f} images/s; "
            f"workers to keep up: JPEG {math.ceil(need / r['jpg'])}, codes {math.ceil(need / r['codes'])}"
        )


if __name__ == "__main__":
    main()
