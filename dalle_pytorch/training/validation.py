"""Validation during training: the loss (and the task's metrics) on held-out samples every --val_every steps,
averaged over the ranks, written to metrics.jsonl, TensorBoard and wandb as val_* and shown to the hooks.

Where the held-out samples come from (held_out): a folder of their own (--val_image_text_folder, or
--val_image_folder for the VAE), else the last --val_fraction of a seeded permutation of the training samples
(removed from training), else, for the built-in data, samples drawn with another seed. For DALLE on the built-in
data, images generated for a few captions of held-out colour-shape pairs are read back by the parser too
(val_heldout_full: compositional generalization as it trains, the demo's headline figure)."""

from __future__ import annotations

import contextlib

import torch

from ..data.build import build_dataset
from ..data.shapes import ShapesDataset


class Split(torch.utils.data.Dataset):
    """Some samples of a dataset, by index, that still answers for it (its caption list, its counters)."""

    def __init__(self, dataset, indices: list[int]):
        self.dataset, self.indices = dataset, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i):
        return self.dataset[self.indices[i]]

    def __getattr__(self, name):  # truncated, num_skipped, captions ...: the whole dataset's
        if name in ("dataset", "indices"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


def held_out(cfg, backend, dataset, *, folder: str, folder_flag: str, captions: bool, image_size: int,
             channels: int, resize_ratio: float):  # fmt: skip
    """(training samples, validation samples or None), as the flags say."""
    if not cfg.val_every:
        if folder or cfg.val_fraction:
            raise ValueError(f"{folder_flag if folder else '--val_fraction'} is read every --val_every N steps: set it")
        return dataset, None
    streamed = isinstance(dataset, torch.utils.data.IterableDataset)
    if folder:
        where = dict(rank=backend.rank, world_size=backend.world_size, seed=cfg.seed, dataset_size=0)
        val = build_dataset(folder, "", captions, image_size, channels, resize_ratio, folder_flag=folder_flag, **where)
        return dataset, val
    if cfg.val_fraction:
        if not 0 < cfg.val_fraction < 1:
            raise ValueError(f"--val_fraction must be between 0 and 1 (got {cfg.val_fraction:g})")
        if streamed:
            raise ValueError(f"--val_fraction needs indexed samples, not streamed shards: give {folder_flag}")
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
        k = max(1, round(len(dataset) * cfg.val_fraction))
        return Split(dataset, sorted(order[k:])), Split(dataset, sorted(order[:k]))
    if isinstance(dataset, ShapesDataset):  # the built-in data: samples of another seed, never trained on
        n = cfg.val_batches * cfg.batch_size * backend.world_size
        return dataset, ShapesDataset(n, dataset.image_size, seed=dataset.seed + 1)
    raise ValueError(f"--val_every needs held-out samples: {folder_flag} or --val_fraction")


def heldout_scenes(dataset, captions: int, cfg, backend) -> ShapesDataset | None:
    """For DALLE on the built-in data with --val_every: `captions` (rounded down to a multiple of the ranks, at
    least one per rank) scenes of the held-out split, whose colour-shape pairs training never shows; else None."""
    if captions < 0:
        raise ValueError(f"--val_heldout_captions must be >= 0 (got {captions})")
    if not (cfg.val_every and captions and isinstance(dataset, ShapesDataset)):
        return None
    n = max(1, captions // backend.world_size) * backend.world_size
    return ShapesDataset(n, dataset.image_size, seed=dataset.seed + 2, split="heldout")


def validate(task, model, backend, cfg, step: int) -> dict:
    """The mean loss and metrics over the first --val_batches batches of each rank's share of the validation
    samples (every rank runs as many batches, as sharded models' forward passes need), and the task's
    val_scores (generated images parsed, on the built-in data), averaged over ranks."""
    val = task.val_dataset
    per_rank = min(cfg.val_batches * cfg.batch_size, len(val) // backend.world_size // cfg.batch_size * cfg.batch_size)
    if per_rank == 0:
        raise ValueError(f"{len(val)} validation samples are fewer than one batch per rank: lower --batch_size")
    indices = list(range(backend.rank, per_rank * backend.world_size, backend.world_size))
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(val, indices), batch_size=cfg.batch_size)
    sums: dict[str, torch.Tensor] = {}
    model.eval()
    with torch.no_grad():
        for batch in loader:
            with backend.autocast():
                loss, metrics = task.loss(model, task.prepare_batch(batch, backend.device), step)
            for k, v in {"loss": loss, **metrics}.items():
                sums[k] = sums.get(k, 0) + v.detach().float()
    model.train()
    means = {k: v / len(loader) for k, v in sums.items()}
    means.update(task.val_scores(lambda: whole_model(backend, model), backend.rank, backend.world_size))
    names = sorted(means)
    means = backend.all_reduce(torch.stack([means[k].to(backend.device).float() for k in names]), op="mean")
    return {f"val_{k}": v for k, v in zip(names, means.tolist())}


@contextlib.contextmanager
def whole_model(backend, model):
    """Collective (every rank enters it): the unwrapped module, every parameter gathered, in eval mode for the
    block; for generating during training (validation's val_scores, the loop's sample grids)."""
    with backend.full_params(model) as module:
        module.eval()
        try:
            yield module
        finally:
            module.train()
