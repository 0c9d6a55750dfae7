"""One CLI system: a config dataclass is also its own command-line spec. `flag` makes a field with a help text;
`add_flags` turns a dataclass into an argument group; `take` fills the dataclass back from the parsed flags.
Every entry point (the trainers, generate.py, the evaluation, convert, plot) builds its parser this way."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import field
from typing import Any


def flag(
    default: Any,
    help: str,
    choices: tuple | None = None,
    type: Callable | None = None,
    aliases: tuple = (),
    positional: bool = False,
) -> Any:
    """A field with a help text; `type` parses a value that the default's type cannot (--top_k 0.9),
    `aliases` are other spellings of the flag; a `positional` one is an optional argument without --."""
    meta = {"help": help, "positional": positional}
    if choices is not None:
        meta["choices"] = choices
    if type is not None:
        meta["type"] = type
    if aliases:
        meta["aliases"] = tuple(aliases)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: default.__class__(default), metadata=meta)
    return field(default=default, metadata=meta)


def add_flags(parser: argparse.ArgumentParser, cls, title: str) -> argparse._ArgumentGroup:
    """An argument group `title` with one --flag per field of `cls` that has a help text."""
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kw = {"help": f.metadata["help"] + " (default: %(default)s)", "default": default}  # set_defaults shows too
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        if isinstance(default, bool):
            kw["action"] = argparse.BooleanOptionalAction
        elif isinstance(default, (list, tuple)):
            kw["nargs"] = "+"
            kw["type"] = type(default[0]) if default else str
        else:
            kw["type"] = f.metadata.get("type") or (type(default) if default is not None else str)
        if f.metadata.get("positional"):
            group.add_argument(f.name, nargs="?", **kw)
            continue
        names = [f"--{f.name}", *(f"--{a}" for a in f.metadata.get("aliases", ()))]
        group.add_argument(*names, **kw)
    return group


def take(ns: argparse.Namespace, cls):
    """The dataclass `cls` filled from the parsed flags that name its fields."""
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)})
