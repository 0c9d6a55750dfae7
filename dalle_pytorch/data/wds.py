"""WebDataset tar shards streamed to every rank and DataLoader worker: `--wds img,cap` with shard URLs.

Local paths, brace patterns (`shards/{000..099}.tar`), folders of shards, `pipe:` commands, http(s) URLs and
object stores (s3://, gs://: storage.py) are accepted. The samples of each shard are counted once
(shard_index.py), so that each epoch's order and each rank's and worker's part of it are arithmetic
(shard_plan.py): a resumed run starts at its next unseen sample without reading what it skips, at the same or
another world size. Batches are drawn across a shuffle block of shards read together; shards from elsewhere are
fetched ahead into a disk cache (shard_cache.py). A sample's augmentation and caption choice are seeded by
(seed, epoch, shard, sample), so it comes out the same whichever worker reads it.

Nothing is lost silently: an unreadable sample yields None (its batch takes another of its samples twice),
counted by reason and said in a warning; a shard that cannot be read at all is named, and more than
--max_bad_shards of them stop the run with a line that says so.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import random
import warnings
from contextlib import closing
from dataclasses import dataclass

import torch

from . import shard_plan
from .folders import image_transform
from .samples import FEATURES_KEY, Skip, caption_features, caption_lines, image_of
from .shard_cache import Prefetcher, ShardCache, default_folder
from .shard_index import UNREADABLE, count_shards
from .shard_plan import Plan
from .shards import RETRIES, Shard, ShardError, open_shard
from .storage import scheme, shard_urls  # noqa: F401 - shard_urls: the stream's API

REASONS = ("unreadable_shard", "missing_from_shard", "missing_key", "bad_image", "bad_caption")
WARNINGS_PER_REASON = 5  # per process; the rest are counted (the run's metrics) but not shown


class DataError(ValueError):
    """Raised in the training process for what a DataLoader worker found (the worker yields it as an item)."""


SHUFFLE_BLOCK = 1 << 18  # samples: MosaicML Streaming's smallest default shuffle block


@dataclass
class StreamOptions:
    """How shards are read (the run's --shard_* and --shuffle_block flags)."""

    retries: int = RETRIES
    max_bad_shards: int = -1  # -1: 1 in 100 of the shards
    shuffle_block: int = SHUFFLE_BLOCK  # samples drawn together across whole shards; 1: one shard at a time
    cache: str = ""  # the folder remote shards are kept in ("": a folder under the system's temporary one)
    cache_gb: float = 20.0
    fetchers: int = 4  # concurrent fetches ahead, per DataLoader worker


class WebDatasetPairs(torch.utils.data.IterableDataset):
    def __init__(
        self,
        urls: str,
        keys: str,
        image_size: int,
        channels: int = 3,
        resize_ratio: float = 0.75,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        options: StreamOptions | None = None,
    ):
        image_key, _, caption_key = keys.partition(",")
        if not image_key:
            raise ValueError(f"--wds must name the image key and the caption key, as in --wds jpg,txt (got {keys!r})")
        self.shards = shard_urls(urls) if isinstance(urls, str) else list(urls)
        if not self.shards:
            raise FileNotFoundError(f"no WebDataset shards in {urls!r}")
        self.image_key, self.caption_key = image_key.lower(), caption_key.lower()
        self.transform = image_transform(image_size, resize_ratio)
        self.mode = "RGBA" if channels == 4 else "RGB"
        self.options = options = options or StreamOptions()
        self.rank, self.world_size, self.seed, self.retries = rank, world_size, seed, options.retries
        self.max_bad_shards = options.max_bad_shards if options.max_bad_shards >= 0 else len(self.shards) // 100
        self.remote = any(_cached(u) for u in self.shards)
        self._cache: ShardCache | None = None
        self.counts: list[int] | None = None
        self.plan: Plan | None = None
        fork = multiprocessing.get_context("fork")
        self._skips = fork.Array("q", len(REASONS))  # shared with the DataLoader's (forked) workers
        self._bad = fork.Array("b", len(self.shards))  # shards found unreadable while training
        self._shown: dict[str, int] = {}

    # ------------------------------------------------------------------ the index
    def count(self, index_path: str = "", add_up=None, say=print) -> None:
        """Count the samples of every shard (kept in `index_path`); `add_up`: the sum over ranks, a collective."""
        why: dict[str, str] = {}
        self.counts = count_shards(
            self.shards, index_path, self.rank, self.world_size, add_up, self.retries, say, cache=self.cache, why=why
        )
        bad = [u for u, n in zip(self.shards, self.counts) if n == UNREADABLE]
        for i, n in enumerate(self.counts):  # every rank knows them: they count towards the limit everywhere
            self._bad[i] = int(n == UNREADABLE)
        if bad and len(bad) > self.max_bad_shards:
            example = next(iter(why.items()), None)
            raise DataError(_too_many(len(bad), len(self.shards), self.max_bad_shards, bad[0], *(example or ())))

    @property
    def num_samples(self) -> int:
        return sum(max(n, 0) for n in self._counts())

    @property
    def order_id(self) -> str:
        """What the epochs' order depends on (the seed, the shards' counts, the shuffle block), as a short digest: a
        plan saved for another order cannot be continued (shards moved elsewhere with their counts can)."""
        key = ["blocks", self.seed, self._counts(), self.options.shuffle_block]  # "blocks": the order since 2026-12
        return hashlib.sha1(json.dumps(key).encode()).hexdigest()[:16]

    @property
    def cache(self) -> ShardCache | None:
        """The disk cache of shards fetched from elsewhere (None when every shard is a local file)."""
        if self._cache is None and self.remote:
            self._cache = ShardCache(self.options.cache or default_folder(), self.options.cache_gb)
        return self._cache

    def _counts(self) -> list[int]:
        if self.counts is None:
            self.count()
        return self.counts

    def describe(self) -> str:
        return f"{len(self.shards)} WebDataset shards, {self.num_samples} samples"

    # ------------------------------------------------------------------ the stream (data/stream.py's contract)
    def set_plan(self, plan: Plan) -> None:
        self.plan = plan

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        plan = self.plan or Plan(0, [(0, self.num_samples)], self.world_size, workers, 1)
        if plan.workers != workers:
            raise ValueError(f"the plan is for {plan.workers} DataLoader workers, not {workers}")
        role = (worker + plan.consumed) % workers  # the worker whose turn it was plays first
        streams = plan.ranks * workers
        mine = shard_plan.stream_ranges(
            plan.ranges, self.rank * workers + role, streams, plan.batch,
            shard_plan.worker_batches(plan.consumed, role, workers),
        )  # fmt: skip
        order = shard_plan.EpochOrder(self._counts(), self.seed, plan.epoch, self.options.shuffle_block)
        with closing(self._items(order, mine)) as items:
            for i, j, shard in items:
                if isinstance(shard, DataError):  # a whole batch of it: drop_last never drops it
                    for _ in range(plan.batch):
                        yield shard
                    return
                if shard is None:
                    yield self._skip("unreadable_shard", f"{self.shards[i]}: the shard could not be read")
                elif j >= len(shard):
                    why = f"{shard.url}: no sample {j} (the shard changed since it was counted)"
                    yield self._skip("missing_from_shard", why)
                else:
                    yield self._decode(shard.read(j), f"{self.seed}/{plan.epoch}/{i}/{j}")

    def _items(self, order: shard_plan.EpochOrder, mine: shard_plan.Ranges):
        """(shard, sample, that shard opened) for every item of `mine`: the shards of the block being read are open
        together (an unreadable one: None, or the DataError that stops the run), those from elsewhere fetched
        ahead into the cache, this block's and the next one's; each block's are closed when the stream leaves it."""
        pieces = list(order.pieces(mine))
        blocks = [b for k, (b, _, _) in enumerate(pieces) if k == 0 or pieces[k - 1][0] != b]
        fetch = None
        if self.cache is not None:
            remote = [[self.shards[i] for i in order.blocks[b] if _cached(self.shards[i])] for b in blocks]
            fetch = Prefetcher(self.cache, remote, self.options.fetchers, self.retries)
        opened: dict[int, object] = {}
        entered = -1
        try:
            for b, start, stop in pieces:
                if entered < 0 or blocks[entered] != b:
                    entered += 1
                    _close(opened)
                    if fetch is not None:
                        fetch.enter(entered)
                for i, j in order.items([(start, stop)]):
                    if i not in opened:
                        opened[i] = self._open(i, fetch)
                    yield i, j, opened[i]
        finally:
            _close(opened)
            if fetch is not None:
                fetch.close()

    def _open(self, i: int, cache=None):
        """Shard i, or None when it cannot be read, or the DataError that stops the run. A shard unreadable, or
        holding another number of samples than its index says (changed since it was counted), is said and counts
        towards --max_bad_shards; of a changed one, the samples its index has room for are still read."""
        try:
            shard = open_shard(self.shards[i], self.retries, cache=cache)
        except ShardError as e:  # whatever the damage: said, counted, never a crash
            return self._bad_shard(i, f"shard {e.url} is unreadable: {e.why}; its samples are skipped", e.why)
        if len(shard) != self._counts()[i]:
            stop = self._bad_shard(i, self._changed(shard, i))
            if stop is not None:
                shard.close()
                return stop
        return shard

    def _bad_shard(self, i: int, what: str, why: str = ""):
        warnings.warn(what, stacklevel=3)
        self._bad[i] = 1
        bad = sum(self._bad)
        if bad > self.max_bad_shards:
            return DataError(_too_many(bad, len(self.shards), self.max_bad_shards, self.shards[i], self.shards[i], why))
        return None

    def _changed(self, shard, i: int) -> str:
        cut = f" (truncated at byte {shard.truncated_at})" if shard.truncated_at is not None else ""
        return (
            f"shard {shard.url} holds {len(shard)} samples{cut}, its index {self._counts()[i]}: it changed since it "
            "was counted; delete its entry in the index (--shards_index, or the run's shards.json) to count it again"
        )

    def _decode(self, sample: dict, seed: str):
        rng = random.Random(seed)
        try:
            if self.caption_key == FEATURES_KEY:  # a text encoder's cached features (the encode command)
                caption = caption_features(sample, self.caption_key, rng)
            else:
                caption = (
                    rng.choice(caption_lines(sample, self.caption_key)) if self.caption_key else ""
                )  # else: a VAE's
            return image_of(sample, self.image_key, self.transform, self.mode, rng.getrandbits(63)), caption
        except Skip as e:
            return self._skip(e.reason, e.what)

    def _skip(self, reason: str, what: str, count: bool = True) -> None:
        if count:
            with self._skips.get_lock():
                self._skips[REASONS.index(reason)] += 1
        shown = self._shown.get(reason, 0)
        if shown < WARNINGS_PER_REASON:
            self._shown[reason] = shown + 1
            more = f" (further {reason} samples are counted, not shown)" if shown + 1 == WARNINGS_PER_REASON else ""
            warnings.warn(f"skipping an unreadable WebDataset sample: {what}{more}", stacklevel=3)
        return None

    def skip_counts(self) -> dict[str, int]:
        """Samples skipped so far in this process and its workers, by reason."""
        return dict(zip(REASONS, self._skips[:]))

    def data_counts(self) -> dict[str, int]:
        """What the run's metrics add up over the ranks: the skipped samples by reason, and the shards found
        unreadable or changed (rank 0 counts those the index found, each rank those it found while training)."""
        found = sum(b for b, n in zip(self._bad, self._counts()) if n != UNREADABLE)  # while training, on this rank
        known = sum(n == UNREADABLE for n in self._counts()) if self.rank == 0 else 0  # the index's: once
        return {**{f"skipped_{k}": v for k, v in self.skip_counts().items()}, "bad_shards": found + known}

    @property
    def num_skipped(self) -> int:
        return sum(self._skips[:])

    def captions(self, limit: int) -> list[str]:
        """Up to `limit` captions, read without decoding images (to train a BPE on)."""
        out: list[str] = []
        for url, n in zip(self.shards, self._counts()):
            if n <= 0:
                continue
            try:
                shard = open_shard(url, self.retries, cache=self.cache)
            except ShardError as e:
                warnings.warn(f"shard {e.url} is unreadable: {e.why}; its captions are skipped", stacklevel=2)
                continue
            for j in range(len(shard)):
                try:
                    out += caption_lines(shard.read(j), self.caption_key)
                except Skip as e:
                    self._skip(e.reason, e.what, count=False)  # said; counted when training reads it
                    continue
                if len(out) >= limit:
                    shard.close()
                    return out[:limit]
            shard.close()
        if not out:
            raise ValueError(
                f"the data yielded no batch: check the dataset and --batch_size (no {self.caption_key} caption "
                "could be read to train the BPE on: see the warnings above)"
            )
        return out


def _cached(url: str) -> bool:
    """Whether shard `url` is read through the disk cache: fetched from elsewhere, or gzipped (decompressed there:
    a block of them is not held in memory)."""
    return scheme(url) != "local" or url.endswith((".gz", ".tgz"))


def _close(opened: dict) -> None:
    for shard in opened.values():
        if isinstance(shard, Shard):
            shard.close()
    opened.clear()


def _too_many(bad: int, total: int, allowed: int, example: str, url: str = "", why: str = "") -> str:
    if why:  # this rank's own finding, with its reason (a wrong key, a missing bucket: every shard's)
        return f"{bad} of {total} shards could not be read, more than --max_bad_shards {allowed}; {url}: {why}"
    return (
        f"{bad} of {total} shards could not be read, more than --max_bad_shards {allowed} (e.g. {example}): "
        "fix or drop them, or raise --max_bad_shards"
    )
