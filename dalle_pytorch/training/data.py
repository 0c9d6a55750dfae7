"""A run's data in one place: what the flags say about it (DataSpec, one per trainer), and `datasets()`, which
returns the training, validation and held-out sets for all three trainers.

Where the validation samples come from: a folder (or, with --wds, shards) of their own (--val_image_text_folder,
or --val_image_folder for the VAE), else the last --val_fraction of a seeded permutation of the training samples
(removed from training), else the dataset's own validation split (the built-in data draws samples of another
seed). The held-out set: for DALLE on a dataset that has one (the built-in data's colour-shape pairs never
trained on), --val_heldout_captions scenes whose generated images the parser reads back (val_heldout_full)."""

from __future__ import annotations

import itertools
import os
import warnings
from dataclasses import dataclass

import torch

from ..data.build import build_dataset, describe
from ..data.stream import is_stream
from .session import add_up
from .validation import Split


@dataclass(frozen=True)
class DataSpec:
    """What the flags say about a trainer's data."""

    folder: str  # --image_folder (VAE) or --image_text_folder: a folder, or shard URLs with `wds`; "": built-in
    folder_flag: str  # its flag, for messages
    wds: str  # WebDataset keys (jpg,txt), or ""
    captions: bool  # image/caption pairs (DALLE, CLIP) or images only (VAE)
    image_size: int
    channels: int
    resize_ratio: float
    val_folder: str = ""  # --val_image_text_folder / --val_image_folder
    val_folder_flag: str = "--val_image_text_folder"
    heldout_captions: int = 0  # --val_heldout_captions (DALLE)


@dataclass
class DataSets:
    train: torch.utils.data.Dataset  # indexed, or streamed (an IterableDataset)
    val: torch.utils.data.Dataset | None  # read every --val_every steps
    heldout: torch.utils.data.Dataset | None = None  # scenes to generate and parse (DALLE on the built-in data)


def datasets(spec: DataSpec, cfg, backend, run) -> DataSets:
    """This rank's training data (streamed shards counted once, into --shards_index or the run's shards.json), its
    validation samples and held-out scenes, said in the run's log."""
    train = build_dataset(
        spec.folder, spec.wds, spec.captions, spec.image_size, spec.channels, spec.resize_ratio,
        rank=backend.rank, world_size=backend.world_size, seed=cfg.seed, dataset_size=cfg.dataset_size,
        folder_flag=spec.folder_flag, stream=cfg.stream_options(),
    )  # fmt: skip
    if is_stream(train):
        index = cfg.shards_index or os.path.join(run.path, "shards.json")
        train.count(index, lambda counts: add_up(backend, counts), run.print)
    run.print(f"data: {describe(train)} from {spec.folder or 'the built-in synthetic dataset'}")
    heldout = heldout_scenes(train, spec.heldout_captions, cfg, backend)
    train, val = held_out(cfg, backend, train, spec)
    return DataSets(train, val, heldout)


def held_out(cfg, backend, dataset, spec: DataSpec):
    """(training samples, validation samples or None), as the flags say."""
    folder, flag = spec.val_folder, spec.val_folder_flag
    if not cfg.val_every:
        if folder or cfg.val_fraction:
            raise ValueError(f"{flag if folder else '--val_fraction'} is read every --val_every N steps: set it")
        return dataset, None
    if folder and spec.wds:
        return dataset, shard_samples(folder, spec, cfg, cfg.val_batches * cfg.batch_size * backend.world_size)
    if folder:
        where = dict(rank=backend.rank, world_size=backend.world_size, seed=cfg.seed, dataset_size=0)
        val = build_dataset(folder, "", spec.captions, spec.image_size, spec.channels, 1.0, folder_flag=flag, **where)
        return dataset, val
    if cfg.val_fraction:
        if not 0 < cfg.val_fraction < 1:
            raise ValueError(f"--val_fraction must be between 0 and 1 (got {cfg.val_fraction:g})")
        if is_stream(dataset):
            raise ValueError(f"--val_fraction needs indexed samples, not streamed shards: give {flag}")
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
        k = max(1, round(len(dataset) * cfg.val_fraction))
        return Split(dataset, sorted(order[k:])), Split(dataset, sorted(order[:k]))
    if hasattr(dataset, "validation_split"):  # the built-in data: samples never trained on, of its own
        return dataset, dataset.validation_split(cfg.val_batches * cfg.batch_size * backend.world_size)
    raise ValueError(f"--val_every needs held-out samples: {flag} or --val_fraction")


def heldout_scenes(dataset, captions: int, cfg, backend):
    """For DALLE with --val_every, on a dataset with a held-out split: `captions` (rounded down to a multiple of the
    ranks, at least one per rank) scenes whose colour-shape pairs training never shows; else None."""
    if captions < 0:
        raise ValueError(f"--val_heldout_captions must be >= 0 (got {captions})")
    if not (cfg.val_every and captions and hasattr(dataset, "heldout_split")):
        return None
    return dataset.heldout_split(max(1, captions // backend.world_size) * backend.world_size)


def shard_samples(urls: str, spec: DataSpec, cfg, n: int) -> list:
    """The first `n` readable samples of the shards `urls` (with the training's --wds keys), centre-cropped, in
    memory: validation samples from shards (--val_image_text_folder 'val/{000..003}.tar'), the same on every
    rank (each validates its share), read once."""
    from ..data.wds import WebDatasetPairs

    keys = spec.wds if spec.captions else spec.wds.split(",")[0]
    stream = WebDatasetPairs(
        urls, keys, spec.image_size, spec.channels, 1.0, seed=cfg.seed, options=cfg.stream_options()
    )
    stream.count(say=warnings.warn)  # a small set: every rank counts it, keeping no index
    samples = list(itertools.islice((item for item in stream if isinstance(item, tuple)), n))
    if not samples:
        raise ValueError(f"{spec.val_folder_flag} {urls}: no sample could be read (see the warnings above)")
    return samples
