"""What a binding run's images are: drawn as the prompt asks, or copied from the training set.

    .venv/bin/python bench/binding_why.py DATA_DIR OUT_DIR [OUT_DIR ...]

Reads what bench/binding.sh wrote (OUT_DIR/images/{heldout,seen}/<prompt>/*.png) against the data it trained on
(DATA_DIR/train, from ../shared/bench/binding.py make). For each split:
- `digit`: the digit read back right (binding.py's SVM), and for a held-out prompt whose digit came out wrong,
  `wrong: seen with its ink`: how often the digit drawn instead is one the training set shows in that ink, against
  `chance` (the share of the other digits that it shows in that ink);
- `nearest`: the pixel distance (RMS over 0-255) from each image to its nearest training image, against the same
  for real digits the model never saw, drawn for the same prompts (`real`: 4 per prompt). Far above `real`: drawn
  unlike anything in the data (malformed); far below: a training image repeated.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import re
import statistics
import sys

import numpy as np
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINDING = os.path.join(os.path.dirname(ROOT), "shared", "bench", "binding.py")
PROMPT = re.compile(r"a[ _](\w+)[ _](\w+)[ _]on[ _](\w+)$")


def load_binding(path: str):
    spec = importlib.util.spec_from_file_location("binding", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def training_set(b, data: str) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """(images float (n, 32*32*3), (digit, ink, ground) of each), read from the captions' first template."""
    images, labels = [], []
    first = re.compile(
        r"the digit (\w+) in (\w+) on a (\w+) background|a (\w+) (\w+) on (\w+)$|(\w+) (\w+), (\w+) ground"
    )
    folder = os.path.join(data, "train")
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".png"):
            continue
        caption = open(os.path.join(folder, name[:-4] + ".txt")).read().splitlines()[0]
        m = first.match(caption).groups()
        d, c, g = (m[0], m[1], m[2]) if m[0] else (m[4], m[3], m[5]) if m[3] else (m[7], m[6], m[8])
        labels.append((b.WORDS.index(d), b.NAMES.index(c), b.NAMES.index(g)))
        images.append(np.asarray(Image.open(os.path.join(folder, name)).convert("RGB"), np.float32).reshape(-1))
    return np.stack(images), labels


def nearest(train: np.ndarray, image: np.ndarray) -> float:
    return float(np.sqrt(((train - image.reshape(1, -1)) ** 2).mean(axis=1).min()))


def real_digits(b, digit: int, ink: int, ground: int, n: int = 4, seed: int = 7) -> list[np.ndarray]:
    """n real `digit`s the training set never drew (scikit-learn's digits past binding.py's pool), drawn as it draws."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    pool = [i for i in range(b.N_POOL, len(digits.target)) if digits.target[i] == digit]
    rng = random.Random(seed + digit)
    return [np.asarray(b.draw(digits.data[i], ink, ground), np.float32) for i in rng.sample(pool, n)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data")
    p.add_argument("outs", nargs="+")
    p.add_argument("--binding", default=BINDING, help="the check's script (binding.py)")
    args = p.parse_args(argv)
    b = load_binding(args.binding)
    clf, _ = b.classifier()
    train, labels = training_set(b, args.data)
    seen_pairs = {(a, c) for a, c, _ in labels}
    for out in args.outs:
        for split in ("heldout", "seen"):
            right = wrong_seen = wrong = 0
            chance, rows, real = [], [], []
            folder = os.path.join(out, "images", split)
            for prompt in sorted(os.listdir(folder)):
                m = PROMPT.search(prompt)
                if not m:
                    continue
                c, a, g = b.NAMES.index(m.group(1)), b.WORDS.index(m.group(2)), b.NAMES.index(m.group(3))
                real += [nearest(train, im) for im in real_digits(b, a, c, g)]
                for png in sorted(f for f in os.listdir(os.path.join(folder, prompt)) if f.endswith(".png")):
                    if png.startswith("grid"):
                        continue
                    im = Image.open(os.path.join(folder, prompt, png)).convert("RGB")
                    x8, _, _ = b.read(im)
                    drawn = int(clf.predict(x8)[0])
                    right += drawn == a
                    if drawn != a:
                        wrong += 1
                        wrong_seen += (drawn, c) in seen_pairs
                        chance.append(sum((k, c) in seen_pairs for k in range(10) if k != a) / 9)
                    rows.append(nearest(train, np.asarray(im, np.float32)))
            n = len(rows)
            line = f"{out} {split}: digit {100 * right / max(n, 1):.0f}% of {n}"
            if split == "heldout" and wrong:
                line += (
                    f"; wrong digits seen with its ink {100 * wrong_seen / wrong:.0f}% "
                    f"(chance {100 * statistics.mean(chance):.0f}%)"
                )
            line += (
                f"; nearest training image {statistics.median(rows):.1f} (median RMS; real digits "
                f"{statistics.median(real):.1f})"
            )
            print(line)


if __name__ == "__main__":
    sys.exit(main())
