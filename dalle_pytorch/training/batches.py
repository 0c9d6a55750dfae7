"""What the loop feeds on: each rank's batches, resumable at the exact next unseen sample (the run's step count
is the plan's: plan.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..data import shard_plan
from ..data.shard_plan import Plan
from ..data.stream import Stream, is_stream
from ..data.wds import DataError


class ShardedSampler(torch.utils.data.Sampler):
    """Disjoint per-rank shards of a seeded per-epoch permutation, resumable at any position.

    Like DistributedSampler with drop_last, plus a start position so that a resumed run continues exactly
    where the interrupted one was instead of replaying the epoch. Rank r takes every world_size-th sample,
    so the samples all ranks have consumed are a prefix of the permutation: the position is one number,
    valid at any world size (a resume on more or fewer ranks, an elastic run losing a worker).
    """

    def __init__(self, length: int, rank: int, world_size: int, seed: int, batch_size: int):
        self.per_rank = self.shard_size(length, world_size, batch_size)
        if self.per_rank == 0:
            raise ValueError(
                f"{length} samples are not enough for one batch of {batch_size} on each of {world_size} ranks: "
                "lower --batch_size or add data"
            )
        self.length, self.rank, self.world_size, self.seed = length, rank, world_size, seed
        self.batch_size = batch_size
        self.epoch, self.consumed = 0, 0

    @staticmethod
    def shard_size(length: int, world_size: int, batch_size: int) -> int:
        """Samples per rank per epoch: an equal share, cut to whole batches."""
        return (length // world_size) // batch_size * batch_size

    def set_position(self, epoch: int, consumed: int) -> None:
        """`consumed`: samples of the epoch's permutation already trained on, by all ranks together."""
        self.epoch, self.consumed = epoch, consumed

    def __len__(self) -> int:
        left = max(self.per_rank * self.world_size - self.consumed, 0)
        return left // self.world_size // self.batch_size * self.batch_size

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(self.length, generator=g)[: self.per_rank * self.world_size]
        return iter(perm[self.consumed :][self.rank :: self.world_size][: len(self)].tolist())


def stream_plan(dataset: Stream, cfg, backend, at: Where, say=print) -> tuple[Plan, Where]:
    """This epoch's plan for a stream at `at` (data/shard_plan.replan), and where the data then stands: the plan
    recorded in `stream`, `samples_in_epoch` of it consumed."""
    layout = {"ranks": backend.world_size, "workers": max(cfg.num_workers, 1), "batch": cfg.batch_size,
              "samples": dataset.num_samples, "order": dataset.order_id}  # fmt: skip
    plan, record, consumed = shard_plan.replan(at.stream, layout, at.epoch, at.samples_in_epoch, say)
    return plan, Where(at.epoch, consumed, record)


def _collate(items: list):
    """A batch of the samples that could be read (None: a skipped one, already counted), its size kept by taking
    the batch's good samples again in the skipped ones' places: every rank's batch has --batch_size samples, as
    CLIP's gather across ranks needs. A worker's DataError is raised here."""
    for item in items:
        if isinstance(item, DataError):
            return item  # raised by batches(), in the training process: one line, not a worker's traceback
    kept = [item for item in items if item is not None]
    if not kept:
        return None
    return torch.utils.data.default_collate([kept[i % len(kept)] for i in range(len(items))])


@dataclass(frozen=True)
class Where:
    """Where the data stands: the epoch, its samples consumed by all ranks together (of a stream: of its plan),
    and a stream's plan for this epoch (shard_plan.replan's record; {} before one is made)."""

    epoch: int = 0
    samples_in_epoch: int = 0
    stream: dict = field(default_factory=dict)


def batches(dataset, cfg, backend, start: Where, say=print):
    """This rank's batches from `start` on, forever, epoch after epoch, each with where the data stands after
    it (the loop keeps that in its position: this generator changes nothing it was given)."""
    streamed = is_stream(dataset)  # split among ranks and workers by its plan
    per_step = cfg.batch_size * backend.world_size
    sampler = None
    if not streamed:
        sampler = ShardedSampler(len(dataset), backend.rank, backend.world_size, cfg.seed, cfg.batch_size)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        num_workers=cfg.num_workers,
        pin_memory=backend.device.type == "cuda",
        drop_last=True,
        collate_fn=_collate if streamed else None,
        # its own generator: creating an iterator must not consume the global RNG, or a resumed run's
        # random stream (Gumbel noise, dropout) would drift from the uninterrupted one
        generator=torch.Generator().manual_seed(cfg.seed + backend.rank),
        multiprocessing_context="fork" if cfg.num_workers > 0 else None,
    )
    at = Where(start.epoch, start.samples_in_epoch, dict(start.stream))
    last = None  # the last batch read whole enough to train on
    while True:
        whole_epoch = at.samples_in_epoch == 0 and not at.stream
        if streamed:  # resumes exactly at the next unseen sample, without reading the ones before it
            plan, at = stream_plan(dataset, cfg, backend, at, say)
            dataset.set_plan(plan)
        else:
            sampler.set_position(at.epoch, at.samples_in_epoch)
        good, owed = False, 0
        for batch in loader:
            if isinstance(batch, DataError):
                raise batch
            if batch is None:  # every sample of it was skipped (and counted): the rank still gives a batch for
                if last is None:  # it (the last one, or the next one twice), so that every rank's position and
                    owed += 1  # steps stay those of the others
                    continue
                batch = last
            else:
                good = True
            last = batch
            for _ in range(owed + 1):
                at = Where(at.epoch, at.samples_in_epoch + per_step, at.stream)
                yield batch, at
            owed = 0
        if (whole_epoch and not good) or owed:
            raise ValueError("the data yielded no batch: check the dataset and --batch_size")
        at = Where(at.epoch + 1, 0, {})
