"""The built-in synthetic captioned dataset: one or two coloured shapes on a plain background.

Every sample is a pure function of (seed, split, index), so any size is free and two processes agree on
sample i without sharing state. Each object has a colour, a shape and a size; a lone object has a
position, a pair has a relation ("left of", "above", ...). Captions come from varied templates.

Compositional generalization is measured on a held-out split: the colour-shape pairs in
`HELD_OUT_PAIRS` never appear in the training split, and every held-out sample contains at least one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from PIL import Image, ImageDraw

# Palette colours are far apart in RGB so that a nearest-colour rule reads them back (see parse.py).
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 80, 230),
    "yellow": (235, 220, 50),
    "purple": (160, 60, 210),
    "cyan": (50, 215, 220),
}
BACKGROUND = (24, 24, 24)
SHAPES = ("circle", "square", "triangle")
SIZES = {"small": 0.22, "large": 0.40}  # side of the bounding box, as a fraction of the image side
POSITIONS = {"center": (0.5, 0.5), "left": (0.25, 0.5), "right": (0.75, 0.5), "top": (0.5, 0.25), "bottom": (0.5, 0.75)}
RELATIONS = ("left of", "right of", "above", "below")
HELD_OUT_PAIRS = frozenset({("red", "triangle"), ("green", "circle"), ("blue", "square"), ("yellow", "triangle")})
SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class Obj:
    color: str
    shape: str
    size: str


@dataclass(frozen=True)
class Scene:
    """What an image shows: one object with a position, or two objects and the relation of the first to the second."""

    objects: tuple[Obj, ...]
    position: str | None = None  # lone object
    relation: str | None = None  # pair: objects[0] <relation> objects[1]


def _phrase(o: Obj, rng: random.Random) -> str:
    size = {"small": rng.choice(["small", "little", "tiny"]), "large": rng.choice(["large", "big"])}[o.size]
    article = "an" if size[0] in "aeiou" else "a"
    return rng.choice([f"{article} {size} {o.color} {o.shape}", f"{size} {o.color} {o.shape}"])


_POSITION_WORDS = {
    "center": ["in the center", "in the middle", "at the center"],
    "left": ["on the left", "at the left"],
    "right": ["on the right", "at the right"],
    "top": ["at the top", "on top"],
    "bottom": ["at the bottom", "on the bottom"],
}
_RELATION_WORDS = {
    "left of": ["left of", "to the left of"],
    "right of": ["right of", "to the right of"],
    "above": ["above", "over"],
    "below": ["below", "under", "beneath"],
}
_INVERSE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


def caption(scene: Scene, rng: random.Random) -> str:
    """One caption for `scene`, from a template chosen by `rng`; every template states every attribute."""
    if scene.position is not None:
        where = rng.choice(_POSITION_WORDS[scene.position])
        what = _phrase(scene.objects[0], rng)
        return rng.choice([f"{what} {where}", f"{where}, {what}", f"{what}, {where}"])
    a, b = scene.objects
    rel = scene.relation
    if rng.random() < 0.5:  # state the same scene from the other object's side
        a, b, rel = b, a, _INVERSE[rel]
    return f"{_phrase(a, rng)} {rng.choice(_RELATION_WORDS[rel])} {_phrase(b, rng)}"


def _random_obj(rng: random.Random) -> Obj:
    return Obj(rng.choice(list(COLORS)), rng.choice(SHAPES), rng.choice(list(SIZES)))


def _is_held_out(o: Obj) -> bool:
    return (o.color, o.shape) in HELD_OUT_PAIRS


def random_scene(rng: random.Random, split: str = "train") -> Scene:
    """A scene of `split`: train scenes never contain a held-out colour-shape pair, held-out scenes always do."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} (got {split!r})")
    while True:
        if rng.random() < 0.4:
            scene = Scene((_random_obj(rng),), position=rng.choice(list(POSITIONS)))
        else:
            a, b = _random_obj(rng), _random_obj(rng)
            if a == b:  # "a red circle left of a red circle" says nothing about which is which
                continue
            scene = Scene((a, b), relation=rng.choice(RELATIONS))
        held = any(_is_held_out(o) for o in scene.objects)
        if held == (split == "heldout"):
            return scene


def _centers(scene: Scene, rng: random.Random) -> list[tuple[float, float]]:
    """Object centres as fractions of the image side; jitter keeps objects inside and apart."""
    j = lambda a: rng.uniform(-a, a)  # noqa: E731
    if scene.position is not None:
        x, y = POSITIONS[scene.position]
        return [(x + j(0.04), y + j(0.04))]
    across, along = 0.5 + j(0.12), (0.25 + j(0.02), 0.75 + j(0.02))
    first, second = {"left of": along, "right of": along[::-1], "above": along, "below": along[::-1]}[scene.relation]
    if scene.relation in ("left of", "right of"):
        return [(first, across), (second, across)]
    return [(across, first), (across, second)]


def shape_mask_polygon(shape: str, x0: float, y0: float, x1: float, y1: float) -> list[tuple[float, float]] | None:
    """The polygon of `shape` in the box, or None for a circle (drawn as an ellipse). Shared with the parser."""
    if shape == "square":
        return [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]
    if shape == "triangle":
        return [((x0 + x1) / 2, y0), (x1, y1), (x0, y1)]
    return None


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[float, float, float, float], fill) -> None:
    poly = shape_mask_polygon(shape, *box)
    if poly is None:
        draw.ellipse(box, fill=fill)
    else:
        draw.polygon(poly, fill=fill)


def render(scene: Scene, image_size: int, rng: random.Random) -> Image.Image:
    img = Image.new("RGB", (image_size, image_size), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for o, (cx, cy) in zip(scene.objects, _centers(scene, rng)):
        half = SIZES[o.size] * image_size / 2
        x, y = cx * image_size, cy * image_size
        draw_shape(draw, o.shape, (x - half, y - half, x + half - 1, y + half - 1), COLORS[o.color])
    return img


def sample(seed: int, index: int, image_size: int = 32, split: str = "train") -> tuple[Image.Image, str, Scene]:
    """Sample `index` of the dataset with `seed`: (image, caption, scene). Deterministic."""
    rng = random.Random(f"{seed}/{split}/{index}")  # str seeds hash stably across processes and runs
    scene = random_scene(rng, split)
    return render(scene, image_size, rng), caption(scene, rng), scene


class ShapesDataset(torch.utils.data.Dataset):
    """`length` samples of one split as (image tensor (3, s, s) in [0, 1], caption)."""

    def __init__(self, length: int = 20000, image_size: int = 32, seed: int = 0, split: str = "train"):
        if image_size < 16:
            raise ValueError(f"--image_size must be at least 16 for the built-in dataset (got {image_size})")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS} (got {split!r})")
        self.length, self.image_size, self.seed, self.split = length, image_size, seed, split

    def __len__(self) -> int:
        return self.length

    def validation_split(self, n: int) -> ShapesDataset:
        """`n` samples drawn with another seed: never trained on (--val_every without a validation folder)."""
        return ShapesDataset(n, self.image_size, seed=self.seed + 1)

    def heldout_split(self, n: int) -> ShapesDataset:
        """`n` scenes whose colour-shape pairs the training split never shows (--val_heldout_captions)."""
        return ShapesDataset(n, self.image_size, seed=self.seed + 2, split="heldout")

    def caption(self, index: int) -> str:
        return sample(self.seed, index, 16, self.split)[1]  # captions do not depend on the image size

    def scene(self, index: int) -> Scene:
        return sample(self.seed, index, self.image_size, self.split)[2]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, str]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        img, text, _ = sample(self.seed, index, self.image_size, self.split)
        return pil_to_tensor(img), text


def pil_to_tensor(img: Image.Image) -> torch.Tensor:
    """(3, h, w) float in [0, 1]."""
    return (
        torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
        .view(img.height, img.width, 3)
        .permute(2, 0, 1)
        .float()
        .div(255)
    )
