"""The stream contract: what the training loop reads of a streamed dataset (WebDatasetPairs, and the wrappers
over it that tokenize its captions), and the one test of whether a dataset is one.

A stream is an IterableDataset whose samples are split among ranks and DataLoader workers by a plan
(shard_plan.py): the loop asks for its counts, hands it each epoch's plan for the run's layout, and reads what
it skipped; it never reaches into a stream for anything else."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .shard_plan import Plan


@runtime_checkable
class Stream(Protocol):
    @property
    def num_samples(self) -> int:
        """Samples of an epoch (the shards' counted samples)."""

    @property
    def order_id(self) -> str:
        """What the epochs' order depends on, as a digest: a plan saved for another cannot be continued."""

    def set_plan(self, plan: Plan) -> None:
        """This epoch's plan, read by every DataLoader worker when the loader's iterator starts."""

    def data_counts(self) -> dict[str, int]:
        """What the run's metrics add up over the ranks: skipped samples by reason, bad shards."""

    def captions(self, limit: int) -> list[str]:
        """Up to `limit` captions, read without decoding images (to train a BPE on)."""

    def describe(self) -> str:
        """One line for the run's log: how many shards, samples."""


def is_stream(dataset) -> bool:
    """Whether `dataset` is split among ranks and workers by a plan (else: indexed, by a sampler)."""
    return isinstance(dataset, torch.utils.data.IterableDataset)
