"""The entry points' flags, read from their own parsers (each main(["--help"]) with every parser it builds
recorded): what tests/test_readme.py checks the README's and docs/' flags against."""

from __future__ import annotations

import argparse
import importlib
import io
import os
import sys
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# entry point as the docs write it -> the module whose main(argv) parses its flags
ENTRY_POINTS = {
    "train_vae.py": "train_vae",
    "train_dalle.py": "train_dalle",
    "train_clip.py": "train_clip",
    "generate.py": "generate",
    "serve.py": "serve",
    "dalle_pytorch.eval": "dalle_pytorch.eval.evaluate",
    "dalle_pytorch.eval.plot": "dalle_pytorch.eval.plot",
    "dalle_pytorch.convert": "dalle_pytorch.convert",
    "dalle_pytorch.training.encode": "dalle_pytorch.training.encode",
    "dalle_pytorch.data.shapes_export": "dalle_pytorch.data.shapes_export",
    "scripts/demo.py": "scripts.demo",
    "scripts/demo_spread.py": "scripts.demo_spread",
}


def flags_of(entry: str) -> set[str]:
    """Every option string of the parsers `entry`'s main() builds ('--batch_size', '-h', ...), as `--help`
    meets them."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    module = importlib.import_module(ENTRY_POINTS[entry])
    made: list[argparse.ArgumentParser] = []
    real_init = argparse.ArgumentParser.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)

    with mock.patch.object(argparse.ArgumentParser, "__init__", init), mock.patch("sys.stdout", io.StringIO()):
        try:
            module.main(["--help"])
        except SystemExit:
            pass
    if not made:
        raise AssertionError(f"{entry}: main() built no parser")
    return set().union(*(p._option_string_actions for p in made))


def all_flags() -> set[str]:
    return set().union(*(flags_of(e) for e in ENTRY_POINTS))
