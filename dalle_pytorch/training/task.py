"""The Task contract: everything the loop reads of what it trains. Tasks are built whole by the trainers
(nothing is patched in afterwards); the loop never asks which task it has."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class Task(Protocol):
    name: str  # "vae", "dalle": names the run in messages
    model: nn.Module  # the trained module, before any backend wrapping
    dataset: torch.utils.data.Dataset  # indexed, or an IterableDataset (streamed shards, with set_plan(plan))
    val_dataset: torch.utils.data.Dataset | None  # held-out samples for --val_every, indexed; None: no validation
    export_path: str  # where export() writes the file generate.py reads
    tokens_per_sample: int  # transformer positions (or image tokens) per sample, for tokens/s

    def activation_bytes(self, batch_size: int) -> float:
        """An estimate of one micro-batch's activation memory: part of the workload the loop hands to the
        backend (backends that size their sharding to the memory read it; the others ignore it)."""

    def prepare_batch(self, batch, device: torch.device):
        """A collated batch on `device`, ready for loss(); no grad, full precision (e.g. VAE tokens)."""

    def loss(self, model: nn.Module, batch, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss to minimize and detached metrics, averaged over the micro-batch."""

    def window_metrics(self) -> dict[str, float]:
        """Metrics over the recent window, logged with the step's (codebook usage, truncated captions)."""

    def val_scores(self, whole_model, rank: int, world_size: int) -> dict[str, torch.Tensor]:
        """Scores beside the validation loss that need the whole model (generated images read back): this
        rank's mean over its equal share; {} for none. Called on every rank; `whole_model()` is a collective
        context giving the unwrapped module in eval mode with every parameter gathered (enter it on every
        rank, or on none)."""

    def fid_reference(self, indices: list[int]) -> torch.Tensor:
        """The validation images at `indices` (n, c, s, s) in [0, 1] on the CPU, that --val_fid_every measures the
        model's images against."""

    def fid_images(self, whole_model, indices: list[int], seed: int) -> torch.Tensor:
        """The model's images for the validation samples at `indices`, (n, c, s, s) in [0, 1] on the CPU: a
        DALLE's for their captions, a VAE's reconstructions. Called on every rank, `whole_model` as in val_scores."""

    def write_samples(self, model: nn.Module, step: int, path: str | None) -> None:
        """Called on every rank (sharded parameters are gathered collectively); writes `path` where not None."""

    def export(self, weights: dict[str, torch.Tensor], ema: dict | None = None) -> None:
        """Rank 0: write `weights` (full, on the CPU) with the config to export_path, and `ema` ({"decay",
        "weights"}: the moving average of the parameters, --ema) beside them."""
