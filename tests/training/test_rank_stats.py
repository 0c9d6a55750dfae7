"""Each rank's figures at every log step, the straggler named, and the summary in train.log: the rule on made-up
figures (milliseconds), then 2 forked ranks (Gloo) through the loop with one rank slowed on purpose."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch
from multirank import on_ranks
from test_loop import FakeTask, config, fit

from dalle_pytorch.training.rank_stats import RankClock, RankSummary, Stragglers


def _rank(own_ms, step_ms=100.0, data_wait_share=0.0):
    return {"step_ms": step_ms, "own_ms": own_ms, "data_wait_share": data_wait_share}


def test_a_rank_slow_for_patience_log_steps_is_named_once_and_again_when_it_keeps_up():
    said = []
    s = Stragglers(["a", "b", "c"], margin=0.25, patience=3, say=said.append)
    slow = [_rank(20), _rank(60), _rank(21)]
    assert [s.see(step, slow) for step in (10, 20)] == [[], []] and not said
    assert s.see(30, slow) == [1] and len(said) == 1
    assert re.search(r"straggler at step 30: rank 1 on b spends 60 ms per step on its own vs 20 ms .* computes slowly",
                     said[0])  # fmt: skip
    s.see(40, slow)
    assert len(said) == 1  # once per episode
    s.see(50, [_rank(20), _rank(21), _rank(20)])
    assert said[1] == "step 50: rank 1 (b) keeps up with the others again"


def test_a_streak_broken_by_one_balanced_log_step_starts_again():
    said = []
    s = Stragglers(["a", "b"], margin=0.25, patience=3, say=said.append)
    for step, own in enumerate([60, 60, 20, 60, 60]):
        s.see(step, [_rank(20), _rank(own)])
    assert not said


def test_balanced_ranks_and_small_differences_name_no_one():
    said = []
    s = Stragglers(["a", "b", "c", "d"], margin=0.25, patience=1, say=said.append)
    s.see(1, [_rank(20), _rank(22), _rank(19), _rank(21)])  # within the margin
    s.see(2, [_rank(2), _rank(4), _rank(2), _rank(2)])  # twice the others', but 2 ms of a 100 ms step
    assert not said


def test_a_rank_that_waits_on_data_is_told_from_one_that_computes_slowly():
    said = []
    s = Stragglers(["a", "b"], margin=0.25, patience=1, say=said.append)
    s.see(1, [_rank(20, data_wait_share=0.05), _rank(70, data_wait_share=0.55)])
    assert "waits on data (55% of its time): raise --num_workers" in said[0]


def test_a_rank_starved_of_cpu_is_told_from_one_that_waits_on_data_or_computes_slowly():
    """The run-queue wait (cpu_wait_ms) names another job on the host; a slow disk (data wait) does not queue."""
    said = []
    s = Stragglers(["a", "b"], margin=0.25, patience=1, say=said.append)
    starved = {**_rank(60, data_wait_share=0.15), "cpu_wait_ms": 80.0}  # its data slowed too, less than its queue
    s.see(1, [{**_rank(20, data_wait_share=0.05), "cpu_wait_ms": 1.0}, starved])
    assert "it computes slowly: its thread waited 80 ms per step for a CPU that other processes held" in said[0]
    s = Stragglers(["a", "b"], margin=0.25, patience=1, say=said.append)
    s.see(1, [{**_rank(20), "cpu_wait_ms": 1.0}, {**_rank(70, data_wait_share=0.55), "cpu_wait_ms": 1.5}])
    assert "waits on data" in said[1]
    s = Stragglers(["a", "b"], margin=0.25, patience=1, say=said.append)
    s.see(1, [{**_rank(20), "cpu_wait_ms": float("nan")}, {**_rank(70), "cpu_wait_ms": float("nan")}])  # no /proc
    assert "computes slowly (data wait 0% of its time)" in said[2]


def test_the_summary_has_a_row_per_rank_with_its_means():
    summary = RankSummary(["hosta", "hostb"])
    summary.add([_rank(10, data_wait_share=0.1), _rank(30)])
    summary.add([_rank(20, data_wait_share=0.3), _rank(50)])
    lines = summary.lines()
    assert lines[0] == "per-rank summary over 2 log steps (means):"
    assert lines[2].split() == ["0", "hosta", "100.0", "15.0", "20.0%"]
    assert lines[3].split() == ["1", "hostb", "100.0", "40.0", "0.0%"]


class Broadcasting(torch.nn.Module):
    """Stands for DDP: a wait for the other ranks (50 ms) at the start of every forward, then the user's module."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        time.sleep(0.05)
        return self.module(x)


def test_the_clock_leaves_the_wrappers_and_the_gathering_hooks_waits_out_of_the_forward():
    block = torch.nn.Linear(4, 4)
    block.register_forward_pre_hook(lambda m, args: time.sleep(0.05), prepend=True)  # as FSDP's gather: first
    inner = torch.nn.Sequential(torch.nn.Linear(4, 4), block)
    inner.register_forward_pre_hook(lambda m, args: time.sleep(0.05))  # the root's gather, before its forward
    model = Broadcasting(inner)
    clock = RankClock(torch.device("cpu"))
    with clock.watching(model, inner, [inner, block]):
        with clock.forward():
            model(torch.ones(2, 4))
            time.sleep(0.02)  # the loss: the rank's own work
        inner(torch.ones(2, 4))  # outside the loop's forward (sampling): not timed
    elapsed, row = clock.figures(1)
    assert elapsed > 0.2 and 20 <= row["own_ms"] < 45, row
    with clock.forward():  # unwatched: the whole forward is the rank's
        model(torch.ones(2, 4))
    assert clock.figures(1)[1]["own_ms"] > 170


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(1000))


def test_a_thread_starved_of_cpu_outside_the_timed_spans_counts_that_wait_as_its_own_and_once():
    """Another process on this thread's core: the run-queue wait outside the clock's spans (as in a backward, which
    the clock cannot time) is added to the rank's own time; the wait inside a span is in its time already."""
    if not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("Linux's schedstat is needed")
    before = os.sched_getaffinity(0)
    core = min(before)
    os.sched_setaffinity(0, {core})
    hog = subprocess.Popen(
        [sys.executable, "-c", "while True: sum(range(100000))"], preexec_fn=lambda: os.sched_setaffinity(0, {core})
    )
    try:
        time.sleep(0.2)  # the hog running
        clock = RankClock(torch.device("cpu"))
        with clock.own():
            _busy(0.3)  # 0.3 s of wall time, of which it waited about half for the CPU
        _busy(0.3)  # outside every span: only its run-queue wait (about half) counts
        elapsed, row = clock.figures(1)
    finally:
        hog.kill()
        hog.wait()
        os.sched_setaffinity(0, before)
    outside = row["own_ms"] - 300  # the own span's wall time
    assert row["cpu_wait_ms"] > 150, row  # the hog held the core
    # the wait outside counted (without it: about 0), and the wait inside the span not again (twice: about cpu_wait)
    assert 50 < outside < row["cpu_wait_ms"] - 50 and row["own_ms"] < 1000 * elapsed, row


class SlowData(torch.utils.data.Dataset):
    """The fake task's samples, each `delay` seconds late (a slow disk or network on one rank)."""

    def __init__(self, dataset, delay):
        self.dataset, self.delay = dataset, delay

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        time.sleep(self.delay)
        return self.dataset[i]


BUSY_HOOK = """
import time

from dalle_pytorch.training.hooks import Hooks


class BusyRank1(Hooks):
    def before_step(self, ctx, step):  # 60 ms of a busy loop on rank 1's core before each step
        end = time.perf_counter() + (0.06 if ctx.rank == 1 else 0)
        while time.perf_counter() < end:
            pass
"""


def _fit_slowed(rank, out, compute_ms, data_ms, hooks):
    """Every rank's forward takes compute_ms[rank] more (a sleep), each of its 8 samples data_ms[rank] / 8."""
    task = FakeTask(os.path.join(out, "fake.pt"), on_loss=lambda step: time.sleep(compute_ms[rank] / 1000))
    task.dataset = SlowData(task.dataset, data_ms[rank] / 8000)
    fit(config(out, distributed_backend="ddp", steps=24, log_every=3, quiet=False, hooks=hooks), task)


def _slowed_run(tmp_path, compute_ms, data_ms, hooks=""):
    out = str(tmp_path)
    on_ranks(2, _fit_slowed, out, compute_ms, data_ms, hooks)
    log = (tmp_path / "run" / "train.log").read_text()
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    return log, rows


def test_a_rank_that_computes_slowly_is_named_within_a_few_log_steps(tmp_path):
    log, rows = _slowed_run(tmp_path, compute_ms=[0, 60], data_ms=[0, 0])
    named = re.findall(r"straggler at step (\d+): rank (\d) on (\S+) .* it computes slowly", log)
    assert [(rank, host) for _, rank, host in named] == [("1", socket.gethostname())], log
    assert int(named[0][0]) <= 4 * 3  # 3 log steps in a row (of 3 steps each), give or take the first
    # every rank's figures, one scalar each, at every log step; the slowed forward shows in rank 1's own time
    assert [r["step"] for r in rows] == list(range(3, 25, 3))
    figures = ("step_ms", "own_ms", "data_wait_share", "cpu_percent", "rss_mb", "peak_memory_mb")
    assert all(f"rank{r}/{f}" in row for row in rows for r in (0, 1) for f in figures)
    last = rows[-1]
    assert last["rank1/own_ms"] > 55 > 10 > last["rank0/own_ms"] and last["rank0/step_ms"] > 55
    assert 0 < last["rank0/rss_mb"] <= last["rank0/peak_memory_mb"]
    assert "per-rank summary over 8 log steps" in log and "memory_mb_per_rank" not in log
    assert not re.search(r"step \d+/24 .*rank1/", log)  # the console line keeps to the reduced figures


def test_a_hook_that_keeps_rank_1_busy_names_it(tmp_path):
    (tmp_path / "busy.py").write_text(BUSY_HOOK)
    log, rows = _slowed_run(tmp_path, compute_ms=[0, 0], data_ms=[0, 0], hooks=f"{tmp_path / 'busy.py'}:BusyRank1")
    named = re.findall(r"straggler at step (\d+): rank (\d) on \S+ .* it computes slowly", log)
    assert [rank for _, rank in named] == ["1"] and int(named[0][0]) <= 12, log
    assert rows[-1]["rank1/cpu_percent"] > 50  # a busy loop, not a sleep


LATE_HOOK = """
import time

from dalle_pytorch.training.hooks import Hooks


class LateRank1(Hooks):
    def after_step(self, ctx, step):  # rank 1 sleeps 60 ms after each step: the others wait in the next forward
        time.sleep(0.06 if ctx.rank == 1 else 0)
"""


def _fit_with_a_buffer(rank, out, backend, hooks):
    task = FakeTask(os.path.join(out, "fake.pt"))
    task.model.register_buffer("scale", torch.ones(1))  # DDP broadcasts buffers at the start of every forward
    fit(config(out, distributed_backend=backend, steps=24, log_every=3, quiet=False, hooks=hooks), task)


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_a_rank_late_after_its_step_is_named_though_the_forward_meets_the_others(backend, tmp_path):
    """The fast rank waits for rank 1 at the start of its next forward (DDP's buffer broadcast, FSDP's gather of
    the root's parameters): that wait must not count as its own time."""
    (tmp_path / "late.py").write_text(LATE_HOOK)
    on_ranks(2, _fit_with_a_buffer, str(tmp_path), backend, f"{tmp_path / 'late.py'}:LateRank1")
    log = (tmp_path / "run" / "train.log").read_text()
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    named = re.findall(r"straggler at step (\d+): rank (\d) on \S+ .* it computes slowly", log)
    assert [rank for _, rank in named] == ["1"] and int(named[0][0]) <= 12, log
    assert rows[-1]["rank1/own_ms"] > 55 > 20 > rows[-1]["rank0/own_ms"], rows[-1]


def test_a_rank_that_waits_on_data_is_named_as_such(tmp_path):
    log, rows = _slowed_run(tmp_path, compute_ms=[0, 0], data_ms=[0, 60])
    assert re.search(r"straggler at step \d+: rank 1 on .* it waits on data \(\d+% of its time\)", log), log
    assert rows[-1]["rank1/data_wait_share"] > 0.5 > 0.2 > rows[-1]["rank0/data_wait_share"]


def test_balanced_ranks_are_not_named(tmp_path):
    log, _ = _slowed_run(tmp_path, compute_ms=[30, 30], data_ms=[10, 10])
    assert "straggler" not in log and "per-rank summary" in log


def test_each_ranks_figures_are_scalars_in_tensorboard_and_wandb(tmp_path, monkeypatch):
    """One scalar per rank and figure (lists were dropped there): TensorBoard's tags and wandb's summary."""
    import glob

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    fit(config(tmp_path, log_every=4, tensorboard=True, wandb=True), FakeTask(str(tmp_path / "x.pt")))
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"rank0/step_ms", "rank0/own_ms", "rank0/cpu_percent", "rank0/rss_mb", "loss"} <= tags
    assert [e.step for e in events.Scalars("rank0/step_ms")] == [4, 8]
    # wandb's offline record (protobuf in a log of records: the history's keys are stored as they are)
    (record,) = glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "run-*.wandb"))
    logged = set(re.findall(rb"rank0/[a-z_]+", open(record, "rb").read()))
    assert {b"rank0/step_ms", b"rank0/own_ms", b"rank0/data_wait_share", b"rank0/peak_memory_mb"} <= logged


def test_the_others_median_is_the_median_of_the_list_without_each_rank():
    import random
    import statistics

    from dalle_pytorch.training.rank_stats import OthersMedian

    rng = random.Random(0)
    for n in (2, 3, 4, 7, 10):
        values = [rng.choice([1.0, 2.0, 5.0, rng.random()]) for _ in range(n)]
        medians = OthersMedian(values)
        for r in range(n):
            assert medians.without(r) == statistics.median(values[:r] + values[r + 1 :]), (values, r)
