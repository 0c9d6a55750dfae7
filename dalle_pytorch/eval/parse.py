"""Read an image of the built-in dataset back into objects, with no neural network.

Colours by the nearest palette entry, objects as connected components of one colour, shape by the best
overlap (IoU) with each ideal shape drawn in the component's bounding box, size by the box side, position
by the centroid. The same code scores VAE reconstructions and generated images, so a loss curve cannot
stand in for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import permutations

import numpy as np
from PIL import Image, ImageDraw

from ..data.shapes import BACKGROUND, COLORS, POSITIONS, SHAPES, SIZES, Scene, draw_shape

_PALETTE = np.array([BACKGROUND, *COLORS.values()], dtype=np.float32)  # index 0 is the background
_NAMES = [None, *COLORS]
_SIZE_THRESHOLD = (SIZES["small"] + SIZES["large"]) / 2


@dataclass(frozen=True)
class Parsed:
    color: str
    shape: str
    size: str
    cx: float  # centroid, as a fraction of the image side
    cy: float
    area: int


def _components(mask: np.ndarray) -> list[np.ndarray]:
    """4-connected components of a boolean mask, as arrays of (y, x) pixel coordinates."""
    seen = np.zeros_like(mask, dtype=bool)
    h, w = mask.shape
    out = []
    for y0, x0 in zip(*np.nonzero(mask)):
        if seen[y0, x0]:
            continue
        seen[y0, x0] = True
        stack, pixels = [(y0, x0)], []
        while stack:
            y, x = stack.pop()
            pixels.append((y, x))
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
        out.append(np.array(pixels))
    return out


def _classify_shape(pixels: np.ndarray) -> str:
    y0, x0 = pixels.min(0)
    y1, x1 = pixels.max(0)
    h, w = y1 - y0 + 1, x1 - x0 + 1
    comp = np.zeros((h, w), dtype=bool)
    comp[pixels[:, 0] - y0, pixels[:, 1] - x0] = True
    best, best_iou = SHAPES[0], -1.0
    for shape in SHAPES:
        canvas = Image.new("1", (w, h), 0)
        draw_shape(ImageDraw.Draw(canvas), shape, (0, 0, w - 1, h - 1), 1)
        ideal = np.array(canvas, dtype=bool)
        iou = (ideal & comp).sum() / max((ideal | comp).sum(), 1)
        if iou > best_iou:
            best, best_iou = shape, iou
    return best


def parse_image(image) -> list[Parsed]:
    """Objects in `image` (PIL image, HWC uint8 array or CHW float tensor in [0, 1]), largest first."""
    arr = _to_array(image)
    side = arr.shape[0]
    dist = ((arr[:, :, None, :].astype(np.float32) - _PALETTE[None, None]) ** 2).sum(-1)
    labels = dist.argmin(-1)  # (h, w) palette index
    min_area = 0.15 * (SIZES["small"] * side) ** 2  # specks from blur or sampling noise are not objects
    objects = []
    for idx in range(1, len(_PALETTE)):
        for pixels in _components(labels == idx):
            if len(pixels) < min_area:
                continue
            extent = (pixels.max(0) - pixels.min(0) + 1).max() / side
            cy, cx = (pixels.mean(0) + 0.5) / side
            size = "small" if extent < _SIZE_THRESHOLD else "large"
            objects.append(Parsed(_NAMES[idx], _classify_shape(pixels), size, float(cx), float(cy), len(pixels)))
    return sorted(objects, key=lambda o: -o.area)


def _to_array(image) -> np.ndarray:
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"))
    if hasattr(image, "detach"):  # a CHW tensor in [0, 1]
        return image.detach().float().clamp(0, 1).mul(255).round().byte().permute(1, 2, 0).cpu().numpy()
    return np.asarray(image)


def position_of(o: Parsed) -> str:
    return min(POSITIONS, key=lambda p: (POSITIONS[p][0] - o.cx) ** 2 + (POSITIONS[p][1] - o.cy) ** 2)


def relation_of(a: Parsed, b: Parsed) -> str:
    dx, dy = a.cx - b.cx, a.cy - b.cy
    if abs(dx) > abs(dy):
        return "left of" if dx < 0 else "right of"
    return "above" if dy < 0 else "below"


ATTRIBUTES = ("count", "color", "shape", "size", "layout")


def score(scene: Scene, parsed: list[Parsed]) -> dict[str, bool]:
    """Per-attribute agreement of `parsed` with `scene`, and `full` when all agree.

    `layout` is the position of a lone object or the relation of a pair. With the wrong number of objects
    the largest ones are compared, so attribute scores stay informative while `full` is False.
    """
    want = scene.objects
    got = parsed[: len(want)]
    result = {"count": len(parsed) == len(want)}
    if len(got) < len(want):
        result.update(color=False, shape=False, size=False, layout=False)
    else:

        def layout_ok(perm) -> bool:
            if scene.position is not None:
                return position_of(perm[0]) == scene.position
            return relation_of(perm[0], perm[1]) == scene.relation

        # the assignment of parsed to wanted objects that agrees on the most attributes, then on the layout
        def agreement(perm):
            attrs = sum((g.color == w.color) + (g.shape == w.shape) + (g.size == w.size) for g, w in zip(perm, want))
            return attrs, layout_ok(perm)

        best = max(permutations(got), key=agreement)
        for attr in ("color", "shape", "size"):
            result[attr] = all(getattr(g, attr) == getattr(w, attr) for g, w in zip(best, want))
        result["layout"] = layout_ok(best)
    result["full"] = all(result[a] for a in ATTRIBUTES)
    return result
