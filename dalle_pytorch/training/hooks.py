"""Hooks: a user's logic in the loop without editing it. `--hooks my_module:MyHooks` (or `path/to/file.py:MyHooks`,
several separated by commas) names classes whose methods the loop calls, on every rank and every backend, with a
HookContext. Subclass Hooks and override what you need:

    from dalle_pytorch.training.hooks import Hooks

    class StopAtLoss(Hooks):
        def on_log(self, ctx, step, row):  # row: the metrics, reduced over the ranks (the same on every rank)
            if row["loss"] < 0.5:
                ctx.request_stop("loss below 0.5")  # every rank saves a checkpoint and the export, then stops

Rank-0-only side effects (printing, files) check `ctx.is_main`. examples/hooks/early_stopping.py is a whole one.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from dataclasses import dataclass, field


@dataclass
class HookContext:
    """What a hook may read, and the one thing it may ask: to stop."""

    task: str  # "vae", "dalle" or "clip"
    rank: int
    world_size: int
    is_main: bool
    run_dir: str
    total_steps: int
    model: object = None  # the user's module, unwrapped (under ZeRO-3 / FSDP its parameters are shards)
    _stop: object = field(default=None, repr=False)  # the loop's StopFlag, set by HookList

    def request_stop(self, reason: str) -> None:
        """Stop after this step (one process) or the next (several: the ranks' vote is read a step late, as for
        SIGTERM): every rank saves a checkpoint and the export."""
        self._stop.request(reason)


class Hooks:
    """Every method is called on every rank; the defaults do nothing. None of them may run collectives."""

    def on_start(self, ctx: HookContext, step: int) -> None:
        """Before the first step (`step`: where a resumed run starts)."""

    def before_step(self, ctx: HookContext, step: int) -> None:
        """Before optimizer step `step + 1`'s micro-batches."""

    def after_step(self, ctx: HookContext, step: int) -> None:
        """After optimizer step `step`. The loss is not read here (that would wait for the device every step)."""

    def on_log(self, ctx: HookContext, step: int, row: dict) -> None:
        """Every --log_every steps, with the row written to metrics.jsonl (reduced over the ranks)."""

    def on_save(self, ctx: HookContext, step: int, path: str) -> None:
        """After a resume checkpoint of `step` was written to `path` (complete)."""

    def on_evaluation(self, ctx: HookContext, step: int, results: dict) -> None:
        """After an evaluation during training (the validation loss and scores)."""

    def on_end(self, ctx: HookContext, step: int) -> None:
        """After the last step (or the stop), when the export is written."""


HOOK_METHODS = tuple(n for n in vars(Hooks) if not n.startswith("_"))


def load_hooks(spec: str) -> list[Hooks]:
    """The hooks `spec` names ('module:Class' or 'file.py:Class', comma-separated), instantiated; errors in one
    line naming what to fix, before any training starts."""
    hooks = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        where, _, name = item.rpartition(":")
        if not where or not name:
            raise ValueError(f"--hooks {item}: expected MODULE:CLASS or path/to/file.py:CLASS")
        module = _import(where, item)
        cls = getattr(module, name, None)
        if not inspect.isclass(cls):
            raise ValueError(f"--hooks {item}: {where} has no class {name}")
        hooks.append(_check(cls, item)())
    return hooks


def _import(where: str, item: str):
    try:
        if where.endswith(".py"):
            if not os.path.exists(where):
                raise FileNotFoundError(f"--hooks {item}: {where} does not exist")
            spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(where))[0], where)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        return importlib.import_module(where)
    except (ImportError, SyntaxError) as e:
        raise ValueError(
            f"--hooks {item}: cannot import {where} ({type(e).__name__}: {e}); put it on PYTHONPATH or give its file"
        ) from None


def _check(cls, item: str):
    """A class that is no Hooks subclass must still define every hook method; a method named like a hook that is
    none (on_logs, after_steps) is a typo that would never be called."""
    own = {n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n))}
    typos = sorted(n for n in own - set(HOOK_METHODS) if n.startswith(("on_", "before_", "after_")))
    if typos:
        raise ValueError(f"--hooks {item}: {', '.join(typos)} is no hook; the hooks are {', '.join(HOOK_METHODS)}")
    if not issubclass(cls, Hooks):
        missing = [n for n in HOOK_METHODS if n not in own]
        if missing:
            raise ValueError(
                f"--hooks {item}: {cls.__name__} lacks {', '.join(missing)}: subclass "
                "dalle_pytorch.training.hooks.Hooks (its methods do nothing) or define them"
            )
    return cls


class HookList:
    """The loop's view: one call per event, to every hook in order."""

    def __init__(self, hooks: list[Hooks], ctx: HookContext, stop):
        self.hooks, self.ctx = hooks, ctx
        ctx._stop = stop  # request_stop sets the flag SIGTERM sets: the same vote stops every rank

    def __getattr__(self, event: str):
        if event not in HOOK_METHODS:
            raise AttributeError(event)

        def call(*args):
            for hook in self.hooks:
                getattr(hook, event)(self.ctx, *args)

        return call
