"""Image and caption/image folders. Corrupt files are skipped and counted, never fatal.

Pairs are matched by their path without extension (`a/1.jpg` with `a/1.txt`), so `a/1.jpg` and
`b/1.jpg` never collide as they would if matched by bare file stem.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import warnings

import torch
from PIL import Image, UnidentifiedImageError
from torchvision.transforms import v2 as T

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


def find_images(root: str) -> list[str]:
    """Image files under `root`, recursively, sorted."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"image folder {root} does not exist")
    found = sorted(
        os.path.join(d, f)
        for d, _, files in os.walk(root, followlinks=True)
        for f in files
        if f.lower().endswith(IMAGE_EXTENSIONS)
    )
    if not found:
        raise FileNotFoundError(f"no images under {root}: expected files ending in {', '.join(IMAGE_EXTENSIONS)}")
    return found


def image_transform(image_size: int, resize_ratio: float = 1.0, train: bool = True):
    """Random resized crop (scale from `resize_ratio` to 1) for training, resize + center crop otherwise."""
    if train and resize_ratio < 1.0:
        crop = T.RandomResizedCrop(image_size, scale=(resize_ratio, 1.0), ratio=(1.0, 1.0), antialias=True)
    else:
        crop = T.Compose([T.Resize(image_size, antialias=True), T.CenterCrop(image_size)])
    return T.Compose([T.ToImage(), crop, T.ToDtype(torch.float32, scale=True)])


class _SkipCorrupt(torch.utils.data.Dataset):
    """Base for file datasets: a sample that fails to load is replaced by the next one and counted.

    The counter lives in shared memory so DataLoader workers (forked) add to the same number.
    """

    def __init__(self):
        self.skipped = multiprocessing.get_context("fork").Value("i", 0)

    def load(self, index: int):
        raise NotImplementedError

    def __getitem__(self, index: int):
        for attempt in range(len(self)):
            i = (index + attempt) % len(self)
            try:
                return self.load(i)
            except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as e:
                with self.skipped.get_lock():
                    self.skipped.value += 1
                warnings.warn(f"skipping unreadable sample {self.describe(i)}: {e}", stacklevel=2)
        raise RuntimeError("every sample in the dataset failed to load")

    def describe(self, index: int) -> str:
        return str(index)

    @property
    def num_skipped(self) -> int:
        return self.skipped.value


def _open_image(path: str, channels: int) -> Image.Image:
    with Image.open(path) as img:
        img.load()
        return img.convert("RGBA" if channels == 4 else "RGB")


class ImageFolder(_SkipCorrupt):
    """Every image under `root` (flat or nested), as float tensors (c, s, s) in [0, 1]."""

    def __init__(self, root: str, image_size: int, channels: int = 3, resize_ratio: float = 1.0):
        super().__init__()
        self.paths = find_images(root)
        self.channels = channels
        self.transform = image_transform(image_size, resize_ratio)

    def __len__(self) -> int:
        return len(self.paths)

    def describe(self, index: int) -> str:
        return self.paths[index]

    def load(self, index: int):
        return (self.transform(_open_image(self.paths[index], self.channels)), "")


class CaptionFolder(_SkipCorrupt):
    """`x.png` beside `x.txt`, found recursively; one random non-empty caption line per sample."""

    def __init__(self, root: str, image_size: int, channels: int = 3, resize_ratio: float = 0.75):
        super().__init__()
        images = {os.path.splitext(p)[0]: p for p in find_images(root)}
        texts = {
            os.path.splitext(os.path.join(d, f))[0]
            for d, _, files in os.walk(root, followlinks=True)
            for f in files
            if f.endswith(".txt")
        }
        keys = sorted(images.keys() & texts)
        if not keys:
            raise FileNotFoundError(f"no image/caption pairs under {root}: expected foo.jpg beside foo.txt")
        self.pairs = [(images[k], k + ".txt") for k in keys]
        self.channels = channels
        self.transform = image_transform(image_size, resize_ratio)

    def __len__(self) -> int:
        return len(self.pairs)

    def describe(self, index: int) -> str:
        return self.pairs[index][0]

    def load(self, index: int):
        image_path, text_path = self.pairs[index]
        with open(text_path, encoding="utf-8") as f:
            lines = [line.strip() for line in f if line.strip()]
        if not lines:
            raise ValueError(f"{text_path} has no non-empty caption line")
        return self.transform(_open_image(image_path, self.channels)), random.choice(lines)
