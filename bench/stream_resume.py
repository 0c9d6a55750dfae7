"""Resuming a streamed WebDataset epoch: time from start to the first batch at 5% and at 90% of the epoch, in one run.

    .venv/bin/python bench/stream_resume.py            # 10,000 256x256 JPEGs in 40 shards of 250, batch 16, 2 workers
    .venv/bin/python bench/stream_resume.py --quick    # 800 samples in 8 shards of 100: under 30 s

What a resumed training run does, timed from its start: a fresh WebDatasetPairs, its count() from the shard
index (shards.json, written once before the timing), then batches() from the Position an uninterrupted run
saved after k batches, to its first batch (the DataLoader workers' start included). The shards are made once
from the built-in shapes (with noise, so the JPEGs are photo-sized) and reused from --data. Also printed: one
DataLoader worker's images/s (the dataset's own __iter__ in one process, one thread, as a worker runs), and
what the replay of the epoch before this change would have cost, estimated from that rate.
"""

from __future__ import annotations

import argparse
import copy
import io
import itertools
import json
import multiprocessing
import os
import statistics
import subprocess
import time
from types import SimpleNamespace

import numpy as np
import torch
from common import one_worker_rate  # common puts the repository on sys.path
from PIL import Image

from dalle_pytorch.data import shard_plan
from dalle_pytorch.data.shapes import sample
from dalle_pytorch.data.shard_index import read_index
from dalle_pytorch.data.shards import open_shard
from dalle_pytorch.data.wds import WebDatasetPairs
from dalle_pytorch.training.batches import Where, batches, stream_plan
from dalle_pytorch.training.loop import Position

SIZE = 256
NOISE = 8.0  # pixel noise (std): 256x256 shapes alone are 4 KB JPEGs, with it about 18 KB, as photos are


def quiet(_line: str) -> None:
    pass


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no lscpu)"
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
    return names[0] if names else "unknown"


# ------------------------------------------------------------------------------------------ the shards


def _jpeg(i: int) -> tuple[bytes, str]:
    img, caption, _ = sample(0, i, SIZE)
    noise = np.random.default_rng(i).normal(0.0, NOISE, (SIZE, SIZE, 3))
    pixels = (np.asarray(img, dtype=np.float32) + noise).clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    return buf.getvalue(), caption


def _write_shard(job: tuple[str, int, int]) -> int:
    import webdataset

    path, first, n = job
    jpeg_bytes = 0
    with webdataset.TarWriter(f"{path}.tmp") as tar:
        for i in range(first, first + n):
            jpg, caption = _jpeg(i)
            tar.write({"__key__": f"{i:08d}", "jpg": jpg, "txt": caption})
            jpeg_bytes += len(jpg)
    os.replace(f"{path}.tmp", path)
    return jpeg_bytes


def make_shards(root: str, samples: int, per_shard: int) -> tuple[list[str], str, float]:
    """The shards under root/SAMPLESxPER_SHARD (made once, 2 processes), their index, the mean JPEG size."""
    folder = os.path.join(root, f"{samples}x{per_shard}")
    done = os.path.join(folder, "done.json")
    n_shards = -(-samples // per_shard)
    urls = [os.path.join(folder, f"{s:05d}.tar") for s in range(n_shards)]
    if not os.path.exists(done):
        os.makedirs(folder, exist_ok=True)
        jobs = [(u, s * per_shard, min(per_shard, samples - s * per_shard)) for s, u in enumerate(urls)]
        t = time.perf_counter()
        with multiprocessing.get_context("fork").Pool(2) as pool:
            total = sum(pool.map(_write_shard, jobs))
        print(f"made {samples} samples in {n_shards} shards in {time.perf_counter() - t:.0f} s: {folder}")
        with open(done, "w") as f:
            json.dump({"samples": samples, "jpeg_bytes": total}, f)
    with open(done) as f:
        mean_jpeg = json.load(f)["jpeg_bytes"] / samples
    index = os.path.join(folder, "shards.json")
    if not os.path.exists(index):  # a real resume finds it in the run directory
        WebDatasetPairs(urls, "jpg,txt", SIZE).count(index, say=quiet)
    return urls, index, mean_jpeg


# ------------------------------------------------------------------------------------------ the resume


def saved_position(urls, index, cfg, backend, done: int) -> Position:
    """The Position an uninterrupted run saves after `done` batches: the plan stream_plan records at the
    epoch's start, and the samples consumed since (over all ranks)."""
    dataset = WebDatasetPairs(urls, "jpg,txt", SIZE, resize_ratio=0.75, seed=cfg.seed)
    dataset.count(index, say=quiet)
    _, where = stream_plan(dataset, cfg, backend, Where(), say=quiet)
    return Position(step=done, samples_in_epoch=done * cfg.batch_size * backend.world_size, stream=where.stream)


def first_batch(urls, index, cfg, backend, pos: Position):
    """(seconds from start to the first batch, the batch): what a resumed run does before its first step."""
    t = time.perf_counter()
    dataset = WebDatasetPairs(urls, "jpg,txt", SIZE, resize_ratio=0.75, seed=cfg.seed)
    dataset.count(index, say=quiet)
    stream = batches(dataset, cfg, backend, copy.deepcopy(pos).data, say=quiet)
    batch, _ = next(stream)
    dt = time.perf_counter() - t
    stream.close()  # the DataLoader's workers stop here, outside the timing
    return dt, batch


def uninterrupted_batch(urls, index, cfg, backend, done: int):
    """Batch `done` + 1 of an uninterrupted run from the epoch's start (reads the `done` batches before it)."""
    dataset = WebDatasetPairs(urls, "jpg,txt", SIZE, resize_ratio=0.75, seed=cfg.seed)
    dataset.count(index, say=quiet)
    stream = batches(dataset, cfg, backend, Where(), say=quiet)
    for _ in range(done):
        next(stream)
    batch, _ = next(stream)
    stream.close()
    return batch


def first_batch_shards(urls, index, cfg, backend, pos: Position) -> int:
    """Shards the resumed run's first batch reads: its worker's next 16 items of the plan (shard_plan.py), as
    WebDatasetPairs.__iter__ finds them; the DataLoader's worker 0 plays the role whose turn it was."""
    known = read_index(index)
    counts = [known[u] for u in urls]
    workers, consumed = cfg.num_workers, pos.samples_in_epoch // cfg.batch_size
    role = consumed % workers
    mine = shard_plan.stream_ranges(
        pos.stream["ranges"], backend.rank * workers + role, backend.world_size * workers, cfg.batch_size,
        shard_plan.worker_batches(consumed, role, workers),
    )  # fmt: skip
    items = shard_plan.EpochOrder(counts, cfg.seed, pos.epoch).items(mine)
    return len({shard for shard, _ in itertools.islice(items, cfg.batch_size)})


def shard_open_s(url: str) -> float:
    """Seconds to open one shard (its tar headers parsed into samples), best of 3."""
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        open_shard(url).close()
        best = min(best, time.perf_counter() - t)
    return best


def same_batch(a, b) -> bool:
    return list(a[1]) == list(b[1]) and torch.equal(a[0], b[0])


# ------------------------------------------------------------------------------------------ one worker


def worker_rate(urls, index, image_size: int, n: int, seed: int) -> float:
    """Images/s of the dataset's own __iter__ (num_workers=0: open shard, read, decode, resize, crop), on one
    thread as in a DataLoader worker; shard opens included."""
    dataset = WebDatasetPairs(urls, "jpg,txt", image_size, resize_ratio=0.75, seed=seed)
    dataset.count(index, say=quiet)
    return one_worker_rate(iter(dataset), n)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="/tmp/dalle-bench-shards", help="folder for the shards (made once, reused)")
    p.add_argument("--quick", action="store_true", help="800 samples in 8 shards of 100, fewer decodes timed")
    p.add_argument("--repeats", type=int, default=3, help="timed starts per position")
    args = p.parse_args(argv)
    samples, per_shard, rate_n = (800, 100, 150) if args.quick else (10_000, 250, 600)
    cfg = SimpleNamespace(batch_size=16, num_workers=2, seed=42)
    backend = SimpleNamespace(world_size=1, rank=0, device=torch.device("cpu"))

    print(f"cpu: {cpu_model()}, {os.cpu_count()} cores")
    urls, index, mean_jpeg = make_shards(args.data, samples, per_shard)
    pos0 = saved_position(urls, index, cfg, backend, 0)
    streams = backend.world_size * cfg.num_workers
    epoch = shard_plan.stream_length([(0, pos0.stream["samples"])], streams, cfg.batch_size) * streams // cfg.batch_size
    print(
        f"data: {samples} samples ({SIZE}x{SIZE} JPEG q90, mean {mean_jpeg / 1024:.1f} KiB, + .txt caption) in "
        f"{len(urls)} shards of {per_shard}, {os.path.dirname(index)}"
    )
    print(f"batch {cfg.batch_size}, {cfg.num_workers} DataLoader workers, 1 rank: an epoch is {epoch} batches")

    fractions = (0.05, 0.90)
    points = {f: max(1, round(f * epoch)) for f in fractions}
    saved = {f: saved_position(urls, index, cfg, backend, k) for f, k in points.items()}

    # the resumed stream is the uninterrupted one: its first batch is the batch the interrupted run had next
    checked = fractions if args.quick else fractions[:1]  # at 90% this reads most of the epoch (slow, untimed)
    for f in checked:
        k = points[f]
        resumed = first_batch(urls, index, cfg, backend, saved[f])[1]
        same = same_batch(resumed, uninterrupted_batch(urls, index, cfg, backend, k))
        print(f"resumed at {f:.0%}: first batch = the uninterrupted run's batch {k + 1}: {'yes' if same else 'NO'}")

    first_batch(urls, index, cfg, backend, saved[fractions[0]])  # warm-up: first-use imports, page cache
    times: dict[float, list[float]] = {f: [] for f in fractions}
    for _ in range(args.repeats):  # interleaved, so a slow spell of the shared machine falls on both
        for f in fractions:
            times[f].append(first_batch(urls, index, cfg, backend, saved[f])[0])
    print(
        f"start to first batch (fresh dataset, count() from {os.path.basename(index)}, batches() to its first batch, "
        f"workers' start included; {args.repeats} runs, median / min):"
    )
    for f in fractions:
        print(
            f"  resumed at {f:3.0%} (after batch {points[f]} of {epoch}): "
            f"{statistics.median(times[f]):.3f} s / {min(times[f]):.3f} s"
        )
    lo, hi = fractions
    ratio_med = statistics.median(times[hi]) / statistics.median(times[lo])
    ratio_min = min(times[hi]) / min(times[lo])
    verdict = "met" if ratio_med <= 1.5 else "NOT met"
    print(f"ratio {hi:.0%} / {lo:.0%}: {ratio_med:.2f} (medians), {ratio_min:.2f} (mins); target <= 1.5: {verdict}")
    opened = ", ".join(f"{f:.0%} {first_batch_shards(urls, index, cfg, backend, saved[f])}" for f in fractions)
    print(
        f"shards the first batch reads: {opened}; opening one ({per_shard} samples: its tar headers parsed) "
        f"takes {shard_open_s(urls[0]) * 1e3:.0f} ms"
    )

    rates = {s: worker_rate(urls, index, s, rate_n, cfg.seed) for s in (256, 64, 32)}
    print(
        "one DataLoader worker (the dataset's own __iter__, 1 thread: read, decode, random resized crop, to float): "
        + ", ".join(f"{s} px {r:.0f} images/s ({1e3 / r:.2f} ms each)" for s, r in rates.items())
    )
    before = points[hi] * cfg.batch_size
    one = before / rates[SIZE]
    print(
        f"replay before this change (an estimate from the measured 256 px rate, not a measurement): reaching "
        f"{hi:.0%} decoded {before} samples first: {one:.1f} s in one worker, {one / cfg.num_workers:.1f} s over "
        f"{cfg.num_workers} workers scaling perfectly; {one / cfg.num_workers / min(times[hi]):.0f}x the measured "
        f"start at {hi:.0%}"
    )


if __name__ == "__main__":
    main()
