"""--ema DECAY: an exponential moving average of the weights, which image generators commonly sample from.

The average is kept beside the weights in the backend's own layout (backend.weights(): whole tensors on each
rank of a replicated backend, each rank's shard under FSDP, each rank's fp32 fragment under DeepSpeed's ZeRO),
so it costs every rank one more copy of what it already holds, never the whole model. It is written into every
resume checkpoint (resharded on load, like the weights), and exported beside the raw weights, which
generate.py and the evaluation then use (--weights raw for the others).
"""

from __future__ import annotations

import torch


def ema_decay(step: int, decay: float) -> float:
    """The decay at optimizer step `step` (0 for the first update): min(decay, (1 + step) / (10 + step)).

    A fixed decay of 0.999 would weigh the random initial weights at 0.999**2000 = 13% after 2000 steps; the
    warm-up (TensorFlow's ExponentialMovingAverage with num_updates, timm's ModelEmaV2 warmup) averages the
    early steps over about the steps so far, then settles at `decay`."""
    return min(decay, (1 + step) / (10 + step))


def check_decay(decay: float) -> None:
    """The one check of --ema's value (0 turns it off and is the caller's to skip): before training starts."""
    if not 0 < decay < 1:
        raise ValueError(f"--ema must be a decay between 0 and 1, e.g. 0.999 (got {decay:g}); 0 turns it off")


class EMA:
    """The moving average of `weights` (a distributed.Weights): update() after every optimizer step."""

    def __init__(self, decay: float, weights):
        check_decay(decay)
        self.decay, self.weights = decay, weights
        self.average = {k: v.detach().clone() for k, v in weights.local.items()}  # same layout, own storage
        self._average = weights.plain(self.average)

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step `step` (0 for the first): average += (1 - decay) * (weights - average)."""
        torch._foreach_lerp_(self._average, self._current(), 1.0 - ema_decay(step, self.decay))

    @torch.no_grad()
    def restart(self) -> None:
        """Start again from the weights as they are (a checkpoint resumed without an average)."""
        torch._foreach_copy_(self._average, self._current())

    def _current(self) -> list[torch.Tensor]:
        """The weights now, where the average is (an offloaded ZeRO-3 partition is read back to the device)."""
        return [w.to(a.device) for w, a in zip(self.weights.current(), self._average)]

    def checkpointable(self) -> dict:
        """Collective: {"ema": the average as the checkpoint writes and reads it}."""
        return {"ema": self.weights.checkpointable(self.average)}

    def export(self) -> dict | None:
        """Collective: {"decay", "weights": whole CPU tensors} on rank 0, None elsewhere."""
        full = self.weights.full(self.average)
        return {"decay": self.decay, "weights": full} if full is not None else None
