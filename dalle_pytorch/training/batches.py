"""What the loop feeds on: each rank's batches, resumable at the exact next unseen sample, and the run's
step count."""

from __future__ import annotations

import torch

from ..data import shard_plan
from ..data.wds import DataError, Plan


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


def total_steps(cfg, dataset, world_size: int) -> int:
    """Optimizer steps of the run: --steps, or --epochs over each rank's shard (a stream: its counted samples)."""
    if cfg.steps:
        return cfg.steps
    if isinstance(dataset, torch.utils.data.IterableDataset):  # every rank's workers: streams of equal length
        workers = max(cfg.num_workers, 1)
        per_rank = shard_plan.stream_length([(0, dataset.num_samples)], world_size * workers, cfg.batch_size) * workers
    else:
        per_rank = ShardedSampler.shard_size(len(dataset), world_size, cfg.batch_size)
    return cfg.epochs * max(per_rank // cfg.batch_size // cfg.accumulation_steps(world_size), 1)


def stream_plan(dataset, cfg, backend, pos, say=print) -> Plan:
    """This epoch's plan for a stream (data/shard_plan.py), from the position: the checkpoint's plan, continued
    where every rank stopped when the layout (ranks, workers, batch size) is the same; what it had left, planned
    again, when not. `pos.stream` records the plan, `pos.samples_in_epoch` the samples of it consumed."""
    workers = max(cfg.num_workers, 1)
    layout = {"ranks": backend.world_size, "workers": workers, "batch": cfg.batch_size, "samples": dataset.num_samples,
              "order": dataset.order_id}  # fmt: skip
    saved = pos.stream or {}
    whole = [(0, dataset.num_samples)]
    if saved and (saved.get("samples"), saved.get("order")) != (layout["samples"], layout["order"]):
        say(
            f"the shards, their counts, --seed or --shuffle_block are not those of the checkpoint "
            f"({layout['samples']} samples now, {saved.get('samples')} then): epoch {pos.epoch} starts over"
        )
        ranges, consumed = whole, 0
    elif not saved or all(saved[k] == layout[k] for k in ("ranks", "workers", "batch")):
        ranges = [tuple(r) for r in saved["ranges"]] if saved else whole
        consumed = pos.samples_in_epoch // (cfg.batch_size * backend.world_size)
    else:
        ranges = shard_plan.remaining(
            [tuple(r) for r in saved["ranges"]], saved["ranks"], saved["workers"], saved["batch"],
            pos.samples_in_epoch // (saved["batch"] * saved["ranks"]),
        )  # fmt: skip
        consumed = 0
        say(
            f"epoch {pos.epoch} was streamed to {saved['ranks']} ranks x {saved['workers']} workers with batch "
            f"{saved['batch']}: its {shard_plan.length(ranges)} samples left go to {backend.world_size} ranks x "
            f"{workers} workers with batch {cfg.batch_size}"
        )
    if consumed == 0:
        pos.samples_in_epoch = 0
    if ranges == whole and shard_plan.stream_length(whole, backend.world_size * workers, cfg.batch_size) == 0:
        raise ValueError(
            f"the data yielded no batch: check the dataset and --batch_size ({dataset.num_samples} samples are "
            f"fewer than a batch of {cfg.batch_size} for each of {backend.world_size} ranks x {workers} workers)"
        )
    pos.stream = {**layout, "ranges": [list(r) for r in ranges]}
    return Plan(pos.epoch, ranges, backend.world_size, workers, cfg.batch_size, consumed)


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


def batches(dataset, cfg, backend, pos, say=print):
    """This rank's batches from `pos` on, forever, epoch after epoch; advances `pos.epoch` and
    `pos.samples_in_epoch` (counted over all ranks) as it yields."""
    streamed = isinstance(dataset, torch.utils.data.IterableDataset)  # split among ranks and workers by its plan
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
    last = None  # the last batch read whole enough to train on
    while True:
        whole_epoch = pos.samples_in_epoch == 0 and not pos.stream
        if streamed:  # resumes exactly at the next unseen sample, without reading the ones before it
            dataset.set_plan(stream_plan(dataset, cfg, backend, pos, say))
        else:
            sampler.set_position(pos.epoch, pos.samples_in_epoch)
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
                pos.samples_in_epoch += per_step
                yield batch
            owed = 0
        if (whole_epoch and not good) or owed:
            raise ValueError("the data yielded no batch: check the dataset and --batch_size")
        pos.epoch, pos.samples_in_epoch, pos.stream = pos.epoch + 1, 0, {}
