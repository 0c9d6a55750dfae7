"""`--hooks` for tests/launchers/test_stragglers.py: rank 1 slowed by 0.3 s per step in turn in its before_step, its
after_step, its data (one slow sample per step) and by a CPU hog beside it, with balanced steps between.

Each rank's main thread is pinned to a core of its own (rank r to core r) so that the hog, pinned to rank 1's core,
slows rank 1 alone, as another job on its host would; unpinned, the kernel would spread the hog over both ranks of
this machine. The threads the ranks started before (TensorBoard's writer, the backends' communication threads)
are left free, as they would be on a host with a core for each."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from dalle_pytorch.data import shapes
from dalle_pytorch.training.hooks import Hooks

SLOW_S = 0.3
LOG_EVERY = 2  # each log step averages 2 steps: the rule sees a 2-rank balanced run's noise halved
# the steps (1-based) each way of slowing rank 1 covers, first and last: 4 log steps each, 3 balanced between
PHASES = {"before_step": (11, 18), "after_step": (25, 32), "data": (39, 46), "hog": (53, 60)}
STEPS = 66


def slowed(way: str, step: int) -> bool:
    first, last = PHASES[way]
    return first <= step <= last


# another job on rank 1's host: 5 busy processes on its core leave it a sixth of the core (about 5x its own time)
HOGS = 5
# a busy loop on the core given as its argument that ends when its parent does (a test that fails midway leaves no
# hog behind). It pins itself: Popen's preexec_fn runs between fork and exec in a copy of a process with threads
# (Horovod's, Gloo's), where a lock another thread held at the fork can hang the child before it ever runs the loop
HOG = (
    "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nparent = os.getppid()\n"
    "while os.getppid() == parent:\n    sum(range(100000))"
)


def core_of(rank: int) -> int:
    cores = sorted(os.sched_getaffinity(0))
    return cores[rank % len(cores)]


class SlowRank1(Hooks):
    def __init__(self):
        self.step = 0  # the step being made (1-based), for the data
        self.hogs = []
        self.slept_in = -1  # the step whose slow sample was read

    def on_start(self, ctx, step):
        os.sched_setaffinity(0, {core_of(ctx.rank)})  # this thread, and the threads it starts from now on
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
        if slowed("hog", step + 1) and not self.hogs:
            core = str(core_of(1))  # rank 1's, as pinned in on_start
            self.hogs = [subprocess.Popen([sys.executable, "-c", HOG, core]) for _ in range(HOGS)]
        elif not slowed("hog", step + 1):
            self._stop_hog()

    def after_step(self, ctx, step):
        if ctx.rank == 1 and slowed("after_step", step):
            time.sleep(SLOW_S)

    def on_end(self, ctx, step):
        self._stop_hog()

    def _stop_hog(self):
        for hog in self.hogs:
            hog.kill()
            hog.wait()
        self.hogs = []
