"""SIGTERM (a preempted node, a scheduler's time limit) as a flag the loop reads at its logging sync."""

from __future__ import annotations

import signal


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
