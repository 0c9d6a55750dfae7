"""`--hooks` for tests/launchers/test_stragglers.py: rank 1 slowed by 0.3 s per step in turn in its before_step, its
after_step, its data (one slow sample per step) and by a CPU hog beside it, with balanced steps between.

The ranks are pinned to a core each (rank r to core r) so that the hog, pinned to rank 1's core, slows rank 1 alone,
as another job on its host would; unpinned, the kernel would spread the hog over both ranks of this machine."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from dalle_pytorch.data import shapes
from dalle_pytorch.training.hooks import Hooks

SLOW_S = 0.3
# the logged steps (1-based) each way of slowing rank 1 covers, first and last; every other step is balanced
PHASES = {"before_step": (7, 10), "after_step": (14, 17), "data": (21, 24), "hog": (28, 32)}
STEPS = 36


def slowed(way: str, step: int) -> bool:
    first, last = PHASES[way]
    return first <= step <= last


# a busy loop that ends when its parent does (a test that fails midway leaves no hog behind)
HOG = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    sum(range(100000))"


def core_of(rank: int) -> int:
    cores = sorted(os.sched_getaffinity(0))
    return cores[rank % len(cores)]


def pin(core: int) -> None:
    """Every thread of this process on one core (threads started later inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:  # a thread that ended meanwhile
            pass


class SlowRank1(Hooks):
    def __init__(self):
        self.step = 0  # the step being made (1-based), for the data
        self.hog = None
        self.slept_in = -1  # the step whose slow sample was read

    def on_start(self, ctx, step):
        pin(core_of(ctx.rank))
        if ctx.rank != 1:
            return
        read = shapes.ShapesDataset.__getitem__

        def slow_sample(dataset, index):  # the first sample of each step in the phase is 0.3 s late
            if slowed("data", self.step) and self.slept_in != self.step:
                self.slept_in = self.step
                time.sleep(SLOW_S)
            return read(dataset, index)

        shapes.ShapesDataset.__getitem__ = slow_sample

    def before_step(self, ctx, step):
        self.step = step + 1
        if ctx.rank != 1:
            return
        if slowed("before_step", step + 1):
            time.sleep(SLOW_S)
        if slowed("hog", step + 1) and self.hog is None:
            core = core_of(1)  # pinned before on_start: rank 1's core
            self.hog = subprocess.Popen([sys.executable, "-c", HOG], preexec_fn=lambda: os.sched_setaffinity(0, {core}))
        elif not slowed("hog", step + 1):
            self._stop_hog()

    def after_step(self, ctx, step):
        if ctx.rank == 1 and slowed("after_step", step):
            time.sleep(SLOW_S)

    def on_end(self, ctx, step):
        self._stop_hog()

    def _stop_hog(self):
        if self.hog is not None:
            self.hog.kill()
            self.hog.wait()
            self.hog = None
