"""One WebDataset sample ({"__key__": ..., extension: bytes}) read as training wants it: its caption lines, its
image (decoded, cropped with a seeded generator) or its pre-encoded image codes (`codes.npy`, written by
`python -m dalle_pytorch.training.encode`). What cannot be read raises Skip with the reason and one line."""

from __future__ import annotations

import io
import json

import torch

CODES_KEY = "codes.npy"  # image token ids of a pre-encoded shard, one (fmap^2,) integer array per sample
# a frozen text encoder's features of every caption line of a pre-encoded shard's sample: an .npz of
# `lengths` (lines,) and `features` (sum of lengths, dim) float16, each line's real tokens only
FEATURES_KEY = "feats.npz"


class Skip(Exception):
    """A sample that cannot be used: `reason` (a metrics name) and `what` (one line naming the sample)."""

    def __init__(self, reason: str, what: str):
        super().__init__(what)
        self.reason, self.what = reason, what


def need(sample: dict, key: str) -> bytes:
    if key not in sample:
        seen = ", ".join(k for k in sample if k != "__key__")
        raise Skip("missing_key", f"{sample['__key__']}: no {key}, the keys seen were {seen}: name them with --wds")
    return sample[key]


def caption_lines(sample: dict, key: str) -> list[str]:
    """The non-empty lines of the caption under `key`: text, or a JSON record's "caption" (or "text") field, as
    img2dataset writes them (`--wds jpg,json`; the predecessor fed the raw JSON to its tokenizer)."""
    raw = need(sample, key)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Skip("bad_caption", f"{sample['__key__']}: the {key} caption is not UTF-8 ({e.reason})") from None
    if key.endswith("json"):
        try:
            record = json.loads(text)
        except ValueError as e:
            raise Skip("bad_caption", f"{sample['__key__']}: the {key} record is not JSON ({e})") from None
        text = record.get("caption") or record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise Skip("bad_caption", f'{sample["__key__"]}: no "caption" or "text" string in the {key} record')
    lines = [t.strip() for t in text.splitlines() if t.strip()]
    if not lines:
        raise Skip("bad_caption", f"{sample['__key__']}: empty caption")
    return lines


def caption_features(sample: dict, key: str, rng) -> torch.Tensor:
    """One caption line's features (its real tokens, float16 (length, dim)), the line drawn by `rng` as a text
    caption's line is (`rng.choice` over the lines draws the same index as `randrange` over their number), so a run
    on cached features reads the captions a run on their text reads."""
    import numpy as np

    raw = need(sample, key)
    try:
        with np.load(io.BytesIO(raw), allow_pickle=False) as z:
            lengths, features = z["lengths"], z["features"]
    except (ValueError, OSError, KeyError) as e:
        raise Skip("bad_caption", f"{sample['__key__']}: unreadable {key} ({e})") from None
    if not len(lengths):
        raise Skip("bad_caption", f"{sample['__key__']}: empty caption")
    i = rng.randrange(len(lengths))
    start = int(lengths[:i].sum())
    return torch.from_numpy(features[start : start + int(lengths[i])].astype(np.float16))


def image_of(sample: dict, key: str, transform, mode: str, seed: int | None) -> torch.Tensor:
    """The image under `key` as a (c, h, w) float tensor, its random crop drawn from `seed` (the same in any
    worker and at any resume; None: a transform without randomness, safe in threads); a pre-encoded shard's
    `codes.npy`: the (fmap^2,) long tensor of its codes."""
    raw = need(sample, key)
    if key == CODES_KEY:
        import numpy as np

        try:
            return torch.from_numpy(np.load(io.BytesIO(raw), allow_pickle=False).astype(np.int64))
        except (ValueError, OSError) as e:
            raise Skip("bad_image", f"{sample['__key__']}: unreadable {key} ({e})") from None
    from PIL import Image

    try:
        with Image.open(io.BytesIO(raw)) as img:
            if seed is None:
                return transform(img.convert(mode))
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(seed)  # the CPU's only: torch.manual_seed would reseed CUDA too
                return transform(img.convert(mode))
    except Exception as e:  # noqa: BLE001 - any broken image is skipped and counted, never fatal
        raise Skip("bad_image", f"{sample['__key__']}: {type(e).__name__}: {e}") from None
