"""What each rank's figures (training/rank_stats.py) cost the loop: 2 processes over Gloo train a small MLP through
the real loop (training_session + train, DDP) with a log step at every step (the worst case), with the per-rank
figures and without them (the loop as it was: metric means alone in the log step's all-reduce), alternating runs
so that both see the same machine load.

    .venv/bin/python bench/rank_metrics.py [--steps 200] [--rounds 3] [--log_every 1]

Prints the step time of each, the cost of the figures per log step, and the collectives that Python issues per
step in each (torch.distributed calls: the figures must add none; DDP's gradient reduction runs in C++ and is the
same in both).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dalle_pytorch.training import metrics  # noqa: E402
from dalle_pytorch.training.configs import TrainConfig  # noqa: E402
from dalle_pytorch.training.loop import train  # noqa: E402
from dalle_pytorch.training.plan import RunPlan  # noqa: E402
from dalle_pytorch.training.rank_stats import RankClock  # noqa: E402
from dalle_pytorch.training.session import training_session  # noqa: E402

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "barrier", "reduce_scatter")


class Regression:
    """A task for the loop: a 2-layer MLP fitted to a fixed linear law."""

    name = "bench"
    tokens_per_sample = 1

    def __init__(self, export_path: str, width: int):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4096, width, generator=g)
        self.dataset = torch.utils.data.TensorDataset(x, x @ torch.randn(width, 1, generator=g))
        torch.manual_seed(1)
        self.model = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1))
        self.export_path = export_path

    def activation_bytes(self, batch_size):
        return 0.0

    def prepare_batch(self, batch, device):
        return [t.to(device) for t in batch]

    def loss(self, model, batch, step):
        x, y = batch
        loss = nn.functional.mse_loss(model(x), y)
        return loss, {}

    def window_metrics(self):
        return {}

    def write_samples(self, model, step, path):
        pass

    def export(self, weights, ema=None):
        pass


class NoFigures:
    """The loop as it was before the per-rank figures: each rank's data wait and peak memory alone in the log
    step's all-reduce, no straggler rule, no summary."""

    def __enter__(self):
        self.saved = metrics.figure_names, metrics.Stragglers.see, metrics.RankSummary.add
        metrics.figure_names = lambda device: ("data_wait_share", "peak_memory_mb")
        metrics.Stragglers.see = lambda self, step, rows: []
        metrics.RankSummary.add = lambda self, rows: None

    def __exit__(self, *exc):
        metrics.figure_names, metrics.Stragglers.see, metrics.RankSummary.add = self.saved


def counted(calls: dict):
    """Count torch.distributed's collectives called from Python (the vote's, the log step's, ...)."""
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def wrapper(*a, _name=name, _original=original, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(*a, **kw)

        setattr(dist, name, wrapper)


def run(rank: int, ports: list[int], args, tmp: str, out) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1")  # fmt: skip
    calls: dict = {}
    counted(calls)
    results = {"with": [], "without": []}
    for r in range(args.rounds):
        for kind in ("with", "without"):
            cfg = TrainConfig(
                steps=args.steps, batch_size=32, learning_rate=1e-3, num_workers=0, output_dir=tmp,
                name=f"{kind}{r}", log_every=args.log_every, sample_every=0, save_every_n_steps=0,
                tensorboard=False, quiet=True, threads=1, distributed_backend="ddp",
            )  # fmt: skip
            task = Regression(os.path.join(tmp, "x.pt"), args.width)
            calls.clear()
            os.environ["MASTER_PORT"] = str(ports.pop())  # a new group each run: its own store
            with NoFigures() if kind == "without" else contextlib.nullcontext():
                plan = RunPlan.make(cfg)
                with training_session(plan, "bench", {"train": cfg}) as (backend, recovery, run_dir):
                    t0 = time.perf_counter()
                    train(task, plan.counted(task.dataset), backend, recovery, run_dir)
                    seconds = time.perf_counter() - t0
            results[kind].append((seconds / args.steps, sum(calls.values()) / args.steps))
    if rank == 0:
        out.put(results)


class Wrapped(nn.Module):
    """Stands for a backend's wrapper (DDP): the loop calls it, it calls the user's module."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def clock_costs(n: int = 20000) -> tuple[float, float]:
    """(microseconds per step, per log step) of RankClock's own work, timed alone over many calls: a step's host
    timings and the hooks that take the wrapper's collective out of a forward (a tiny module called through a
    wrapper, less the same calls without the clock)."""
    model, x = Wrapped(nn.Linear(1, 1)), torch.ones(1, 1)
    clock = RankClock(torch.device("cpu"))

    def steps(timed: bool) -> float:
        own = clock.own if timed else contextlib.nullcontext
        forward = clock.forward if timed else contextlib.nullcontext
        t0 = time.perf_counter()
        for _ in range(n):
            with own():  # the hooks before the step
                pass
            with own():  # preparing the batch
                pass
            with forward():
                model(x)
            with own():  # the hooks after the step
                pass
        return (time.perf_counter() - t0) / n

    bare = min(steps(False) for _ in range(3))
    with clock.watching(model, model.module):
        timed = min(steps(True) for _ in range(3))
    t0 = time.perf_counter()
    for _ in range(n // 10):
        clock.figures(10)
    return 1e6 * (timed - bare), 1e6 * (time.perf_counter() - t0) / (n // 10)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--log_every", type=int, default=1)
    p.add_argument("--width", type=int, default=256)
    args = p.parse_args(argv)
    ports = []
    for _ in range(2 * args.rounds):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:  # one run directory for both ranks, as a shared filesystem
        procs = [ctx.Process(target=run, args=(r, ports, args, tmp, out)) for r in range(2)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
    if any(proc.exitcode for proc in procs):
        raise SystemExit("a rank failed (see above)")
    results = out.get()
    per_step_us, per_log_us = clock_costs()
    print(f"the rank's clock alone: {per_step_us:.1f} us per step (3 host timings, the forward's and its hooks), "
          f"{per_log_us:.0f} us per log step (its figures: /proc statm, schedstat, getrusage, CPU time)")  # fmt: skip
    print(f"2 ranks (Gloo, DDP), MLP width {args.width}, batch 32, {args.steps} steps x {args.rounds} rounds each, "
          f"a log step every {args.log_every} step(s)")  # fmt: skip
    for kind in ("without", "with"):
        times = [t * 1000 for t, _ in results[kind]]
        print(f"{kind + ' per-rank figures':<28} step {statistics.median(times):7.3f} ms (runs {min(times):.3f}-"
              f"{max(times):.3f})   torch.distributed calls per step {results[kind][0][1]:.2f}")  # fmt: skip
    with_ms = statistics.median(t for t, _ in results["with"]) * 1000
    without_ms = statistics.median(t for t, _ in results["without"]) * 1000
    per_log = (with_ms - without_ms) * args.log_every
    print(f"the figures cost {with_ms - without_ms:+.3f} ms per step ({100 * (with_ms / without_ms - 1):+.1f}%), "
          f"{per_log:+.3f} ms per log step; extra collectives per step: "
          f"{results['with'][0][1] - results['without'][0][1]:+.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
