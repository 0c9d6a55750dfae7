"""Validation during training: the loss (and the task's metrics) on held-out samples every --val_every steps,
averaged over the ranks, written to metrics.jsonl, TensorBoard and wandb as val_* and shown to the hooks. For DALLE
on the built-in data, images generated for a few captions of held-out colour-shape pairs are read back by the
parser too (val_heldout_full: compositional generalization as it trains, the demo's headline figure). Where the
samples come from: training/data.py."""

from __future__ import annotations

import contextlib

import torch


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
