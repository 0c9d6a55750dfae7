"""A run's data in one place: what the flags say about it (data.build.DataSpec, one per trainer: `image_data`,
`caption_data`), and `datasets()`, which returns the training, validation and held-out sets for all three
trainers.

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

from ..data.build import DataSpec, build_dataset, describe
from ..data.stream import is_stream
from .session import add_up
from .validation import Split


def image_data(run_cfg, cfg, image_size: int, channels: int) -> DataSpec:
    """train_vae.py's data flags (VAERunConfig) with the run's (TrainConfig: seed, built-in size, stream)."""
    return DataSpec(
        run_cfg.image_folder, "--image_folder", run_cfg.wds, captions=False, image_size=image_size,
        channels=channels, resize_ratio=run_cfg.resize_ratio, val_folder=run_cfg.val_image_folder,
        val_folder_flag="--val_image_folder", seed=cfg.seed, dataset_size=cfg.dataset_size,
        stream=cfg.stream_options(),
    )  # fmt: skip


def caption_data(run_cfg, cfg, image_size: int, channels: int, heldout_captions: int = 0) -> DataSpec:
    """The data flags of train_dalle.py and train_clip.py (CaptionDataConfig) with the run's (TrainConfig)."""
    return DataSpec(
        run_cfg.image_text_folder, "--image_text_folder", run_cfg.wds, captions=True, image_size=image_size,
        channels=channels, resize_ratio=run_cfg.resize_ratio, val_folder=run_cfg.val_image_text_folder,
        val_folder_flag="--val_image_text_folder", heldout_captions=heldout_captions, seed=cfg.seed,
        dataset_size=cfg.dataset_size, stream=cfg.stream_options(),
    )  # fmt: skip


@dataclass
class DataSets:
    train: torch.utils.data.Dataset  # indexed, or streamed (an IterableDataset)
    val: torch.utils.data.Dataset | None  # read every --val_every steps
    heldout: torch.utils.data.Dataset | None = None  # scenes to generate and parse (DALLE on the built-in data)


def datasets(spec: DataSpec, cfg, backend, run) -> DataSets:
    """This rank's training data (streamed shards counted once, into --shards_index or the run's shards.json), its
    validation samples and held-out scenes, said in the run's log."""
    train = build_dataset(spec, backend.rank, backend.world_size)
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
        return dataset, shard_samples(spec.validation(), cfg.val_batches * cfg.batch_size * backend.world_size)
    if folder:
        return dataset, build_dataset(spec.validation(), backend.rank, backend.world_size)
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


def shard_samples(spec: DataSpec, n: int) -> list:
    """The first `n` readable samples of the shards `spec` names (the validation's: --val_image_text_folder
    'val/{000..003}.tar' with the training's --wds keys), centre-cropped, in memory, the same on every rank (each
    validates its share), read once."""
    stream = build_dataset(spec)
    stream.count(say=warnings.warn)  # a small set: every rank counts it, keeping no index
    samples = list(itertools.islice((item for item in stream if isinstance(item, tuple)), n))
    if not samples:
        raise ValueError(f"{spec.folder_flag} {spec.folder}: no sample could be read (see the warnings above)")
    return samples
