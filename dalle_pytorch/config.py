"""One CLI system: a config dataclass is also its own command-line spec. `flag` makes a field with a help text;
`add_flags` turns a dataclass into an argument group; `take` fills the dataclass back from the parsed flags, `pick` from
a record (config.json) or another config.
Every entry point (the trainers, generate.py, the evaluation, convert, plot) builds its parser this way."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import field
from typing import Any


def flag(
    default: Any,
    help: str,
    choices: tuple | None = None,
    type: Callable | None = None,
    aliases: tuple = (),
    positional: bool = False,
    const: Any = None,
) -> Any:
    """A field with a help text; `type` parses a value that the default's type cannot (--top_k 0.9),
    `aliases` are other spellings of the flag; a `positional` one is an optional argument without --; with
    `const` the flag's value is optional (`--mlflow` alone means `const`, `--mlflow URI` the URI)."""
    meta = {"help": help, "positional": positional}
    if const is not None:
        meta["const"] = const
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
        if "const" in f.metadata:
            kw.update(nargs="?", const=f.metadata["const"])
        if f.metadata.get("positional"):
            group.add_argument(f.name, nargs="?", **kw)
            continue
        names = [f"--{f.name}", *(f"--{a}" for a in f.metadata.get("aliases", ()))]
        group.add_argument(*names, **kw)
    return group


def take(ns: argparse.Namespace, cls):
    """The dataclass `cls` filled from the parsed flags that name its fields."""
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)})


def pick(cls, source):
    """The dataclass `cls` from the fields of `source` that name its own: a record (config.json's section, a dict)
    or another config with those fields. A key the record lacks (a run recorded before the field existed) takes
    the field's default: where such runs behaved otherwise (--bpe_lowercase), the caller reads the record itself."""
    if isinstance(source, Mapping):
        return cls(**{f.name: source[f.name] for f in dataclasses.fields(cls) if f.name in source})
    return cls(**{f.name: getattr(source, f.name) for f in dataclasses.fields(cls) if hasattr(source, f.name)})


class FileParser(argparse.ArgumentParser):
    """An entry point's parser with `--config FILE`: a YAML or JSON file of flag values (flat, or in sections as
    a run's config.yaml has them), under the command line, which overrides it. Unknown keys, values outside a
    flag's choices and files that do not parse end in one line, before anything runs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument(
            "--config",
            default="",
            help="a YAML or JSON file of flag values (a run's config.yaml relaunches that run); the command line "
            "overrides it",
        )

    def parse_args(self, args=None, namespace=None):
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--config", default="")
        path = pre.parse_known_args(args)[0].config
        if path:
            try:
                self.set_defaults(**self.read_config(path))
            except ValueError as e:
                self.exit(2, f"error: {e}\n")
        return super().parse_args(args, namespace)

    def read_config(self, path: str) -> dict:
        """The flag values in `path`, checked against this parser's flags and converted to their types."""
        import difflib

        import yaml

        try:
            with open(path) as f:
                data = yaml.safe_load(f)  # YAML 1.1 reads JSON too
        except OSError as e:
            raise ValueError(f"--config {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ValueError(f"--config {path} does not parse as YAML or JSON: {str(e).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise ValueError(f"--config {path}: expected a mapping of flag names to values, like `batch_size: 8`")
        actions = {a.dest: a for a in self._actions if a.dest not in ("help", "config")}
        values = {}
        for key, value in data.items():
            if key == "derived":  # what a run worked out (world size, ...), not a flag
                continue
            if isinstance(value, dict):  # a section of a run's config.yaml (no flag takes a mapping)
                values.update(value)
            else:
                values[key] = value
        unknown = [k for k in values if k not in actions]
        if unknown and "derived" in data:  # a run's config.json: what ran, derived values included
            beside = os.path.join(os.path.dirname(path), "config.yaml")
            raise ValueError(
                f"--config {path} is a run's record (what it worked out, {unknown[0]!r} among it, is no flag): "
                f"relaunch the run with its flags, --config {beside}"
            )
        if unknown:
            hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, actions, 1)) else repr(k)
                     for k in unknown]  # fmt: skip
            raise ValueError(f"--config {path}: unknown key {', '.join(hints)}")
        return {k: _convert(actions[k], v, path) for k, v in values.items()}


def _convert(action: argparse.Action, value, path: str):
    """`value` as the command line would have given it: the flag's type, within its choices."""
    if value is not None and action.type is not None and not isinstance(value, bool):
        try:
            value = [action.type(v) for v in value] if isinstance(value, list) else action.type(value)
        except (TypeError, ValueError):
            raise ValueError(f"--config {path}: {action.dest}: {value!r} is not a {action.type.__name__}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"--config {path}: {action.dest} must be one of {', '.join(map(str, action.choices))}")
    if isinstance(action, argparse.BooleanOptionalAction) and not isinstance(value, bool):
        raise ValueError(f"--config {path}: {action.dest} must be true or false (got {value!r})")
    return value
