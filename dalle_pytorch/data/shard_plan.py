"""Where each sample of a streamed epoch goes, by arithmetic on the shards' sample counts (as MosaicML Streaming
and webdataset's wids do), so that a resumed run skips what it has trained on without reading it.

The epoch's order is a pure function of (seed, epoch, the counts): the shards in a seeded order, each shard's
samples in a seeded permutation of their own, all of it one sequence G of N (shard, sample) items. A *plan* is a
list of ranges of G (the whole of G when an epoch starts) cut into S = ranks x workers equal streams of whole
batches; stream s = rank * workers + worker reads its part in order, one shard at a time. The DataLoader takes a
rank's batches from its workers in turn, so after C batches on every rank, worker w has given
`worker_batches(C, w, W)` of them: the position is one number, and the rest of every stream is known exactly.

Resumed with the same ranks, workers and batch size, the plan is kept and each stream starts at its next
unseen sample (the DataLoader's first worker plays the role of the one whose turn it was), so the resumed run
sees the uninterrupted run's batches. With any other layout, what is left of every stream (and the few samples
the last cut dropped) becomes the new plan's ranges: every sample of the epoch is still seen once.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterator

Ranges = list[tuple[int, int]]  # half-open ranges of G


class EpochOrder:
    """G for one epoch: item k -> (shard, sample in shard), without materializing the N items."""

    def __init__(self, counts: list[int], seed: int, epoch: int):
        self.counts, self.seed, self.epoch = counts, seed, epoch
        shards = [i for i, n in enumerate(counts) if n > 0]
        random.Random(f"shards/{seed}/{epoch}").shuffle(shards)
        self.shards = shards
        self.starts = [0]
        for i in shards:
            self.starts.append(self.starts[-1] + counts[i])
        self._perm: tuple[int, list[int]] | None = None

    @property
    def total(self) -> int:
        return self.starts[-1]

    def permutation(self, shard: int) -> list[int]:
        """The order of one shard's samples in this epoch (the last one asked for is kept)."""
        if self._perm is None or self._perm[0] != shard:
            order = list(range(self.counts[shard]))
            random.Random(f"samples/{self.seed}/{self.epoch}/{shard}").shuffle(order)
            self._perm = (shard, order)
        return self._perm[1]

    def items(self, ranges: Ranges) -> Iterator[tuple[int, int]]:
        """(shard, sample) of every item in `ranges`, in order."""
        for start, end in ranges:
            k = start
            while k < end:
                j = bisect.bisect_right(self.starts, k) - 1
                shard = self.shards[j]
                stop = min(end, self.starts[j + 1])
                perm = self.permutation(shard)
                for offset in range(k - self.starts[j], stop - self.starts[j]):
                    yield shard, perm[offset]
                k = stop


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
