"""Where each sample of a streamed epoch goes, by arithmetic on the shards' sample counts (as MosaicML Streaming
and webdataset's wids do), so that a resumed run skips what it has trained on without reading it.

The epoch's order is a pure function of (seed, epoch, the counts, the shuffle block): the shards in a seeded
order, grouped into blocks of whole shards, each block's samples in a seeded permutation across its shards, all
of it one sequence G of N (shard, sample) items. A *plan* is a list of ranges of G (the whole of G when an epoch
starts) cut into S = ranks x workers equal streams of whole batches; stream s = rank * workers + worker reads its
part in order, with the shards of the block it is in open together. The DataLoader takes a
rank's batches from its workers in turn, so after C batches on every rank, worker w has given
`worker_batches(C, w, W)` of them: the position is one number, and the rest of every stream is known exactly.

Resumed with the same ranks, workers and batch size, the plan is kept and each stream starts at its next
unseen sample (the DataLoader's first worker plays the role of the one whose turn it was), so the resumed run
sees the uninterrupted run's batches. With any other layout, what is left of every stream (and the few samples
the last cut dropped) becomes the new plan's ranges: every sample of the epoch is still seen once.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

Ranges = list[tuple[int, int]]  # half-open ranges of G


@dataclass
class Plan:
    """This epoch's part for the ranks (shard_plan.py): `ranges` of the epoch's order, cut into ranks x workers
    streams of whole batches; every rank has already taken `consumed` batches of it."""

    epoch: int
    ranges: list[tuple[int, int]]
    ranks: int
    workers: int
    batch: int
    consumed: int = 0


class EpochOrder:
    """G for one epoch: item k -> (shard, sample in shard), without materializing the N items.

    The shards in a seeded order are grouped into *shuffle blocks* of at least `block` samples (whole shards, in
    that order), and each block's samples are one seeded permutation of all of them, so that any run of items
    (a stream's batch) is drawn across the block's shards, as MosaicML Streaming's py1b shuffle does: shards
    written in source order (sorted by class, crawl date, source) still give mixed batches. `block` <= 1: every
    shard is its own block (one shard at a time, the order of the first streamed runs)."""

    def __init__(self, counts: list[int], seed: int, epoch: int, block: int = 1):
        self.counts, self.seed, self.epoch, self.block = counts, seed, epoch, block
        shards = [i for i, n in enumerate(counts) if n > 0]
        random.Random(f"shards/{seed}/{epoch}").shuffle(shards)
        self.shards = shards
        self.blocks: list[list[int]] = []  # the shards of each block
        self.starts = [0]  # where each block starts in G
        for i in shards:
            if not self.blocks or self.starts[-1] - self.starts[-2] >= max(block, 1):
                self.blocks.append([])
                self.starts.append(self.starts[-1])
            self.blocks[-1].append(i)
            self.starts[-1] += counts[i]
        self._perm: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None

    @property
    def total(self) -> int:
        return self.starts[-1]

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(order, shard starts, shards) of block b: order[p] is the block's p-th item in the concatenation of
        its shards' samples (the last block asked for is kept)."""
        if self._perm is None or self._perm[0] != b:
            shards = self.blocks[b]
            sizes = [self.counts[i] for i in shards]
            digest = hashlib.sha256(f"samples/{self.seed}/{self.epoch}/{shards[0]}".encode()).digest()
            # RandomState: numpy keeps its streams fixed across versions (Generator's may change), so a run
            # resumed under another numpy reads the same order
            order = np.random.RandomState(int.from_bytes(digest[:4], "little")).permutation(sum(sizes))
            self._perm = (b, order, np.cumsum([0, *sizes]), np.array(shards))
        return self._perm[1:]

    def block_of(self, k: int) -> int:
        return bisect.bisect_right(self.starts, k) - 1

    def pieces(self, ranges: Ranges) -> Iterator[tuple[int, int, int]]:
        """(block, start, stop): `ranges` cut where blocks end."""
        for start, end in ranges:
            k = start
            while k < end:
                b = self.block_of(k)
                stop = min(end, self.starts[b + 1])
                yield b, k, stop
                k = stop

    def items(self, ranges: Ranges) -> Iterator[tuple[int, int]]:
        """(shard, sample) of every item in `ranges`, in order."""
        for b, start, stop in self.pieces(ranges):
            order, shard_starts, shards = self._block(b)
            picked = order[start - self.starts[b] : stop - self.starts[b]]
            where = np.searchsorted(shard_starts, picked, side="right") - 1
            yield from zip(shards[where].tolist(), (picked - shard_starts[where]).tolist())


def length(ranges: Ranges) -> int:
    return sum(b - a for a, b in ranges)


def cut(ranges: Ranges, start: int, end: int) -> Ranges:
    """Items [start, end) of the sequence the ranges make, as ranges of G."""
    out: Ranges = []
    seen = 0
    for a, b in ranges:
        lo, hi = max(a, a + start - seen), min(b, a + end - seen)
        if lo < hi:
            out.append((lo, hi))
        seen += b - a
        if seen >= end:
            break
    return out


def merge(ranges: Ranges) -> Ranges:
    """Adjacent ranges joined (a plan stays a handful of numbers after many resumes)."""
    out: Ranges = []
    for a, b in ranges:
        if a >= b:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def stream_length(ranges: Ranges, streams: int, batch: int) -> int:
    """Items per stream: an equal share of the plan, cut to whole batches (so every rank has as many batches)."""
    return length(ranges) // streams // batch * batch


def worker_batches(consumed: int, worker: int, workers: int) -> int:
    """Of a rank's first `consumed` batches, how many came from `worker` (the DataLoader takes them in turn)."""
    return max(0, (consumed - worker + workers - 1) // workers)


def stream_ranges(ranges: Ranges, stream: int, streams: int, batch: int, skip_batches: int = 0) -> Ranges:
    """Stream `stream`'s items of the plan, after its first `skip_batches` batches."""
    n = stream_length(ranges, streams, batch)
    return cut(ranges, stream * n + skip_batches * batch, (stream + 1) * n)


def remaining(ranges: Ranges, ranks: int, workers: int, batch: int, consumed: int) -> Ranges:
    """What the plan has not given yet after `consumed` batches on every rank: the rest of every stream, then the
    items the cut to whole batches left over, as ranges of G (a new plan, for another layout)."""
    streams = ranks * workers
    n = stream_length(ranges, streams, batch)
    left: Ranges = []
    for s in range(streams):
        left += stream_ranges(ranges, s, streams, batch, worker_batches(consumed, s % workers, workers))
    left += cut(ranges, streams * n, length(ranges))
    return merge(left)


def replan(saved: dict, layout: dict, epoch: int, samples_in_epoch: int, say=print) -> tuple[Plan, dict, int]:
    """This epoch's plan for a layout, from what a checkpoint recorded of it (`saved`: {} at an epoch's start):
    the saved plan, continued where every rank stopped, when the layout (ranks, workers, batch) is the same;
    what it had left, planned anew, when not; the whole epoch when the data's order changed. `layout`: ranks,
    workers, batch, samples and order (the stream's order_id). Returns (the plan, the record of it for the next
    checkpoint, the samples of it consumed)."""
    whole = [(0, layout["samples"])]
    ranks, workers, batch = layout["ranks"], layout["workers"], layout["batch"]
    if saved and (saved.get("samples"), saved.get("order")) != (layout["samples"], layout["order"]):
        say(
            f"the shards, their counts, --seed or --shuffle_block are not those of the checkpoint "
            f"({layout['samples']} samples now, {saved.get('samples')} then): epoch {epoch} starts over"
        )
        ranges, consumed = whole, 0
    elif not saved or all(saved[k] == layout[k] for k in ("ranks", "workers", "batch")):
        ranges = [tuple(r) for r in saved["ranges"]] if saved else whole
        consumed = samples_in_epoch // (batch * ranks)
    else:
        ranges = remaining(
            [tuple(r) for r in saved["ranges"]], saved["ranks"], saved["workers"], saved["batch"],
            samples_in_epoch // (saved["batch"] * saved["ranks"]),
        )  # fmt: skip
        consumed = 0
        say(
            f"epoch {epoch} was streamed to {saved['ranks']} ranks x {saved['workers']} workers with batch "
            f"{saved['batch']}: its {length(ranges)} samples left go to {ranks} ranks x {workers} workers with "
            f"batch {batch}"
        )
    if ranges == whole and stream_length(whole, ranks * workers, batch) == 0:
        raise ValueError(
            f"the data yielded no batch: check the dataset and --batch_size ({layout['samples']} samples are fewer "
            f"than a batch of {batch} for each of {ranks} ranks x {workers} workers)"
        )
    record = {**layout, "ranges": [list(r) for r in ranges]}
    return Plan(epoch, ranges, ranks, workers, batch, consumed), record, samples_in_epoch if consumed else 0
