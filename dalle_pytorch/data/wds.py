"""WebDataset tar shards streamed per node and per DataLoader worker: `--wds img,cap` with shard URLs.

Shards are split by rank first (each process reads its own shards), then by DataLoader worker, so no
sample is read twice in an epoch. Local paths, brace patterns (`shards/{000..099}.tar`), `pipe:` commands
and http(s) URLs are accepted. Unreadable samples are skipped and counted.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import warnings

import torch
import webdataset as wds
from webdataset.shardlists import expand_urls

from .folders import image_transform


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
        shuffle_buffer: int = 1000,
    ):
        image_key, _, caption_key = keys.partition(",")
        if not image_key:
            raise ValueError(f"--wds must name the image key and the caption key, as in --wds jpg,txt (got {keys!r})")
        self.shards = _shard_urls(urls) if isinstance(urls, str) else list(urls)
        if not self.shards:
            raise FileNotFoundError(f"no WebDataset shards in {urls!r}")
        # fewer shards than processes (one big tar on 8 GPUs): every process reads them all and keeps every
        # world_size-th sample, instead of splitting the shards (more reading, the same samples once each)
        self.split_samples = len(self.shards) < world_size
        self.image_key, self.caption_key = image_key, caption_key
        self.transform = image_transform(image_size, resize_ratio)
        self.mode = "RGBA" if channels == 4 else "RGB"
        self.rank, self.world_size, self.seed, self.shuffle_buffer = rank, world_size, seed, shuffle_buffer
        self.epoch = 0
        self.skipped = multiprocessing.get_context("fork").Value("i", 0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def my_shards(self) -> list[str]:
        """This rank's and this worker's shards, in this epoch's order."""
        shards = list(self.shards)
        random.Random(self.seed + self.epoch).shuffle(shards)
        if self.split_samples:
            return shards
        shards = shards[self.rank :: self.world_size]
        info = torch.utils.data.get_worker_info()
        if info is not None:
            shards = shards[info.id :: info.num_workers]
        return shards

    def _mine(self, index: int, info) -> bool:
        """With split_samples: whether sample `index` of the stream belongs to this rank and worker."""
        if not self.split_samples:
            return True
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return index % (self.world_size * workers) == self.rank * workers + worker

    def _skip(self, exn) -> bool:
        with self.skipped.get_lock():
            self.skipped.value += 1
        warnings.warn(f"skipping an unreadable WebDataset sample: {exn}", stacklevel=2)
        return True

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        rng = random.Random(f"{self.seed}/{self.epoch}/{self.rank}/{worker}")
        samples = wds.tarfile_to_samples(handler=self._skip)([{"url": u} for u in self.my_shards()])
        buffer: list = []
        for index, sample in enumerate(samples):
            if not self._mine(index, info):
                continue
            item = self._decode(sample)
            if item is None:
                continue
            if self.shuffle_buffer <= 1:
                yield item
                continue
            buffer.append(item)
            if len(buffer) >= self.shuffle_buffer:
                yield buffer.pop(rng.randrange(len(buffer)))
        rng.shuffle(buffer)
        yield from buffer

    def _decode(self, sample: dict):
        import io

        from PIL import Image

        try:
            with Image.open(io.BytesIO(sample[self.image_key])) as img:
                image = self.transform(img.convert(self.mode))
            if not self.caption_key:  # images only (the VAE)
                return image, ""
            lines = [t.strip() for t in _caption_text(sample, self.caption_key).splitlines() if t.strip()]
            if not lines:
                raise ValueError("empty caption")
            return image, random.choice(lines)
        except Exception as e:  # noqa: BLE001 - any broken sample is skipped and counted, never fatal
            self._skip(f"{sample.get('__key__', '?')}: {type(e).__name__}: {e}")
            return None

    @property
    def num_skipped(self) -> int:
        return self.skipped.value


def _shard_urls(urls: str) -> list[str]:
    """Brace patterns, URLs and `pipe:` commands as webdataset expands them; a folder: the shards under it,
    found recursively (as lucidrains' DALLE-pytorch took `--image_text_folder SHARD_FOLDER`)."""
    if os.path.isdir(urls):
        found = sorted(
            os.path.join(d, f)
            for d, _, files in os.walk(urls)
            for f in files
            if f.endswith((".tar", ".tar.gz", ".tgz"))
        )
        if not found:
            raise FileNotFoundError(f"no WebDataset shards (.tar, .tar.gz) under {urls}")
        return found
    return sorted(expand_urls(urls))


def _caption_text(sample: dict, key: str) -> str:
    """The caption under `key`: text, or a JSON record's "caption" (or "text") field, as img2dataset writes
    them (`--wds jpg,json`); the predecessor fed the raw JSON to its tokenizer."""
    raw = sample[key].decode("utf-8")
    if not key.endswith("json"):
        return raw
    record = json.loads(raw)
    caption = record.get("caption") or record.get("text") if isinstance(record, dict) else None
    if not isinstance(caption, str):
        raise ValueError(f'no "caption" or "text" string in the {key} record')
    return caption
