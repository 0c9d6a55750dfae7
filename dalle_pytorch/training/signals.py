"""SIGTERM (a preempted node, a scheduler's time limit, `scontrol requeue`) as a flag, and the ranks' vote on
it: every rank stops at the same step, at most one step after the first signal, and no step waits for the vote."""

from __future__ import annotations

import signal

import torch


class StopFlag:
    def __init__(self):
        self.set = False

    def __enter__(self) -> StopFlag:
        self._old = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, *_):
        self.set = True

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGTERM, self._old)


class StopVote:
    """Whether any rank was signalled, the same answer on every rank at the same step. Each step starts a sum of
    the ranks' flags and reads the one started the step before, which had a whole step to arrive: no step waits
    for it (no host sync per step), and a signal during step k stops the job after step k+1 at the latest.
    One process needs no vote: it stops after the step the signal came in."""

    def __init__(self, flag: StopFlag, backend):
        self.flag, self.backend = flag, backend
        self._pending = None  # the previous step's vote

    def __call__(self) -> bool:
        """Call once per step, on every rank."""
        if self.backend.world_size == 1:
            return self.flag.set
        previous = self._pending
        self._pending = self.backend.all_reduce_async(torch.tensor([float(self.flag.set)]), "sum")
        return previous is not None and previous().item() > 0

    def close(self) -> None:
        """Wait for the vote still under way, so that no rank leaves while a peer's is pending."""
        if self._pending is not None:
            self._pending()
            self._pending = None
