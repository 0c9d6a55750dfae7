"""What the loop feeds on: each rank's batches, resumable at the exact next unseen sample, and the run's
step count."""

from __future__ import annotations

import torch


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
    """Optimizer steps of the run: --steps, or --epochs over each rank's shard (a stream needs --steps)."""
    if cfg.steps:
        return cfg.steps
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise ValueError("streamed WebDataset shards have no known length: set --steps")
    per_rank = ShardedSampler.shard_size(len(dataset), world_size, cfg.batch_size)
    return cfg.epochs * max(per_rank // cfg.batch_size // cfg.accumulation_steps(world_size), 1)


def batches(dataset, cfg, backend, pos):
    """This rank's batches from `pos` on, forever, epoch after epoch; advances `pos.epoch` and
    `pos.samples_in_epoch` (counted over all ranks) as it yields."""
    streamed = isinstance(dataset, torch.utils.data.IterableDataset)  # shards split per rank by the dataset
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
        # its own generator: creating an iterator must not consume the global RNG, or a resumed run's
        # random stream (Gumbel noise, dropout) would drift from the uninterrupted one
        generator=torch.Generator().manual_seed(cfg.seed + backend.rank),
        multiprocessing_context="fork" if cfg.num_workers > 0 else None,
    )
    while True:
        skip = 0
        if sampler is not None:  # resumes exactly at the next unseen sample
            sampler.set_position(pos.epoch, pos.samples_in_epoch)
        else:  # a stream is replayed to the resume position (same shard order and shuffle seeds)
            dataset.set_epoch(pos.epoch)
            skip = pos.samples_in_epoch // per_step
        for i, batch in enumerate(loader):
            if i < skip:
                continue
            pos.samples_in_epoch += per_step
            yield batch
        if pos.samples_in_epoch == 0:
            raise ValueError("the data yielded no batch: check the dataset and --batch_size")
        pos.epoch, pos.samples_in_epoch = pos.epoch + 1, 0
