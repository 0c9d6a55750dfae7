"""Schedules as pure functions of the optimizer step, so resuming at step s gives the value at s exactly."""

from __future__ import annotations

import math


def lr_factor(
    step: int, total_steps: int, warmup_steps: int = 0, decay: str = "cosine", min_factor: float = 0.1
) -> float:
    """Multiplier of the base learning rate: linear warmup from 0, then `decay` from 1 to `min_factor`.

    decay: "cosine" (half cosine), "exponential" (geometric interpolation), "linear", or "constant".
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant":
        return 1.0
    span = max(total_steps - warmup_steps, 1)
    t = min(max(step - warmup_steps, 0) / span, 1.0)
    return anneal(1.0, min_factor, t, decay)


def anneal(start: float, end: float, t: float, kind: str) -> float:
    """Value at fraction t in [0, 1] of the way from `start` to `end`."""
    if kind == "cosine":
        return end + (start - end) * 0.5 * (1 + math.cos(math.pi * t))
    if kind == "exponential":
        return start * (end / start) ** t
    if kind == "linear":
        return start + (end - start) * t
    if kind == "constant":
        return start
    raise ValueError(f"unknown schedule {kind!r}: use cosine, exponential, linear or constant")


def gumbel_temperature(step: int, start: float, end: float, anneal_steps: int, kind: str = "cosine") -> float:
    """Gumbel-softmax temperature at `step`: from `start` to the floor `end` over `anneal_steps`, then flat.

    A function of the step, not a running product: the reference multiplied the current temperature by
    exp(-rate * step) at every epoch, compounding the decay; this never drifts with resumes or epochs.
    """
    t = min(step / anneal_steps, 1.0) if anneal_steps > 0 else 1.0
    return anneal(start, end, t, kind)
