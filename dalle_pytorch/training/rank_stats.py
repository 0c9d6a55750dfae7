"""Each rank's own figures at every log step, and the rank that holds the others back named.

The figures ride in the one all-reduce the loop makes per log step (metrics.py): every rank writes its row into
its own slot of a (world size x figures) tensor, the sum is everyone's rows. Nothing is synchronised per step.

Why `own_ms`: in data-parallel training the ranks meet in every step's collectives, so the wall time per step is
the same on every rank (the fast ones wait there for the slowest). What differs is the time each rank spends
outside every collective: waiting for its batch, preparing it, its hooks, and the compute of its forward pass. A
rank whose own time stays above the others' is the straggler; its data wait says whether it waits on data or
computes slowly. The forward and loss are timed less their collectives: the span from the call of the backend's
wrapper to the start of the user's module's forward (DDP broadcasts the module's buffers there at every forward; FSDP
and ZeRO-3 gather the root's parameters), and the time in the gathering pre-hooks of FSDP's blocks and ZeRO-3's
modules (`Backend.forward_watch`). Without that, a fast rank's forward holds its wait for the slow one, and both
ranks show the same own time. A rank starved of CPU (another job on its host) is slowed in its backward and
optimizer step too, which the clock cannot time (the backward overlaps the gradient reduction on every backend, so
its time holds the wait for the others): the time its loop's thread waited on the run queue outside the timed spans
is added to its own time, since a thread ready to run is waiting for a CPU, never for another rank (a rank waiting
in a collective sleeps). What it cannot see: a rank slow in its backward's compute alone (a throttled device), in a
checkpoint write, or in validation and sampling (collective sections).
"""

from __future__ import annotations

import math
import os
import socket
import time
from contextlib import contextmanager

import torch

HOST_FIGURES = ("step_ms", "own_ms", "data_wait_share", "cpu_percent", "cpu_wait_ms", "rss_mb", "peak_memory_mb")
GPU_FIGURES = ("gpu_util_percent",)  # on CUDA: peak_memory_mb is then the device's peak allocation


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    # Linux: KiB, and updated by the kernel a little behind the RSS read now
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, _rss_mb())


class RankClock:
    """This rank's time between two log steps: its own work (data, hooks, the forward and loss less the collectives
    in them) and the process's CPU. On CUDA the forward is timed by events on the device's stream (read at the log
    step, which waits for the device anyway), since the host only queues kernels; elsewhere by the host's clock."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._timing = False  # inside the loop's forward()
        self._entry = self._gather = None  # the model's call, a gathering hook: started at (host seconds or event,
        # run-queue seconds)
        self.queue = RunQueue()
        self.reset()

    def reset(self) -> None:
        self.queue.follow()  # the thread that runs the loop (under Ray not the main one)
        self.t0, self.cpu0, self.queued0 = time.perf_counter(), time.process_time(), self.queue.seconds()
        self.wait = 0.0  # seconds in next(data)
        self.host = 0.0  # seconds of own work on the host (hooks, batches; the forward off CUDA)
        self.spans: list[tuple] = []  # CUDA: (start, end, sign) events: + a forward, - a collective inside it
        self.queued_timed = 0.0  # run-queue seconds inside the timed spans (already in wait, host or spans)

    def waiting(self):
        """The wait for the next batch."""
        return self._timed("wait")

    def own(self):
        """Work of this rank alone (a hook, preparing a batch), timed by the host."""
        return self._timed("host")

    @contextmanager
    def _timed(self, bucket: str):
        """The host's time in the context added to `bucket` (wait or host), and its run-queue time to what the
        timed spans hold."""
        t0, q0 = time.perf_counter(), self.queue.seconds()
        try:
            yield
        finally:
            setattr(self, bucket, getattr(self, bucket) + time.perf_counter() - t0)
            self.queued_timed += self.queue.seconds() - q0

    @contextmanager
    def watching(self, model: torch.nn.Module, module: torch.nn.Module, gathering: list[torch.nn.Module] = ()):
        """Take the collectives out of the forward's time while the context lasts: `model` is what the loop calls
        (a backend's wrapper), `module` the user's module inside it, and `gathering` the submodules whose forward
        pre-hooks gather their parameters (Backend.forward_watch). From the call of `model` to the start of
        `module`'s forward the wrapper may meet the other ranks (DDP's buffer broadcast, FSDP's and ZeRO-3's gather
        of the root's parameters), and so may each gathering hook: those times are left out. Registered after the
        backend wrapped the model, so our hooks run first on `model` and around the backend's on the others."""
        handles = [
            model.register_forward_pre_hook(self._call_starts, prepend=True),
            module.register_forward_pre_hook(self._forward_starts),
        ]
        for m in gathering:
            if m is not module:  # the root's gather is already before its forward starts
                handles += [
                    m.register_forward_pre_hook(self._gather_starts, prepend=True),
                    m.register_forward_pre_hook(self._gather_ends),
                ]
        try:
            yield
        finally:  # an elastic recovery watches the model again, with a new clock
            for h in handles:
                h.remove()

    @contextmanager
    def forward(self):
        """The loop's forward and loss, less what the watched hooks find collective in it."""
        start = self._start()
        self._timing, self._entry = True, None
        try:
            yield
        finally:
            self._timing = False
            self._span(start, +1)

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _start(self) -> tuple:
        return self._now(), self.queue.seconds()

    def _span(self, start: tuple, sign: int) -> None:
        """`sign` x the time from `start` (_start) to now: + the forward, - a collective inside it."""
        start, queued = start
        end = self._now()
        self.queued_timed += sign * (self.queue.seconds() - queued)
        if self.cuda:
            self.spans.append((start, end, sign))
        else:
            self.host += sign * (end - start)

    # the hooks read Python clocks: a compiled model (--compile) calls them outside its graph
    @torch.compiler.disable
    def _call_starts(self, module, args):
        if self._timing and self._entry is None:
            self._entry = self._start()

    @torch.compiler.disable
    def _forward_starts(self, module, args):
        if self._timing and self._entry is not None:
            self._span(self._entry, -1)
            self._entry = None

    @torch.compiler.disable
    def _gather_starts(self, module, args):
        if self._timing:
            self._gather = self._start()

    @torch.compiler.disable
    def _gather_ends(self, module, args):
        if self._timing and self._gather is not None:
            self._span(self._gather, -1)
            self._gather = None

    def figures(self, steps: int) -> tuple[float, dict[str, float]]:
        """(seconds since the last reset, this rank's figures per optimizer step over them)."""
        elapsed = time.perf_counter() - self.t0
        device_s = 0.0
        if self.spans:
            self.spans[-1][1].synchronize()  # the log step's all-reduce waits for the device anyway
            device_s = sum(sign * s.elapsed_time(e) for s, e, sign in self.spans) / 1000
        queued = self.queue.seconds() - self.queued0
        starved = queued - self.queued_timed  # waiting for a CPU in the backward, the optimizer step, a collective
        starved = max(starved, 0.0) if math.isfinite(starved) else 0.0
        row = {
            "step_ms": 1000 * elapsed / steps,
            "own_ms": 1000 * (self.wait + self.host + device_s + starved) / steps,
            "data_wait_share": self.wait / elapsed,
            "cpu_percent": 100 * (time.process_time() - self.cpu0) / elapsed,  # of one core, all threads
            "cpu_wait_ms": 1000 * queued / steps,  # the loop's thread, ready but not run
            "rss_mb": _rss_mb(),
            "peak_memory_mb": peak_memory_mb(self.device),
        }
        if self.cuda:
            row["gpu_util_percent"] = _gpu_utilisation(self.device)
        return elapsed, row


def _rss_mb() -> float:
    """The process's resident memory now (Linux: /proc/self/statm's second field, in pages)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


class RunQueue:
    """Seconds a thread has waited, ready to run, for a CPU that other threads held (Linux's schedstat: on-CPU ns,
    run-queue ns, timeslices); NaN elsewhere. The file is kept open and read again at offset 0 (about 1 us; opening
    it costs 12), for the thread that last called `follow`."""

    def __init__(self):
        self.fd = None

    def follow(self) -> None:
        self.close()
        try:
            self.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self.fd = None

    def seconds(self) -> float:
        if self.fd is None:
            return math.nan
        try:
            return int(os.pread(self.fd, 128, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return math.nan

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self):
        self.close()


def _gpu_utilisation(device: torch.device) -> float:
    """NVML's utilisation of the device over its last sample period (%), NaN without nvidia-ml-py."""
    try:
        return float(torch.cuda.utilization(device))
    except Exception:  # noqa: BLE001 - pynvml missing, or NVML not answering: the figure is left out
        return float("nan")


def figure_names(device: torch.device) -> tuple[str, ...]:
    return HOST_FIGURES + (GPU_FIGURES if device.type == "cuda" else ())


def hostnames(backend) -> list[str]:
    """Every rank's host name (one collective, when the loop starts): each rank writes its name's bytes into its
    own row of a zero tensor, the sum is every row."""
    width = 64
    rows = torch.zeros(backend.world_size, width, dtype=torch.int32, device=backend.device)
    name = socket.gethostname().encode()[:width]
    rows[backend.rank, : len(name)] = torch.tensor(list(name), dtype=torch.int32)
    rows = backend.all_reduce(rows, op="sum").cpu()
    return [bytes(v for v in row.tolist() if v).decode(errors="replace") for row in rows]


class Stragglers:
    """Names a rank whose own time per step stays above the others' median by `margin` (a fraction) and by a
    tenth of the step (what every rank loses waiting for it) for `patience` log steps in a row; says once per
    episode, and again once it has caught up."""

    def __init__(self, hosts: list[str], margin: float, patience: int, say):
        self.hosts, self.margin, self.patience, self.say = hosts, margin, patience, say
        self.streak = [0] * len(hosts)
        self.named: set[int] = set()

    def see(self, step: int, per_rank: list[dict]) -> list[int]:
        """The log step's figures of every rank; returns the ranks named at this step."""
        if self.patience <= 0 or len(per_rank) < 2:
            return []
        named = []
        own = OthersMedian([p["own_ms"] for p in per_rank])
        for r, mine in enumerate(per_rank):
            typical = own.without(r)
            excess = mine["own_ms"] - typical
            slow = excess > self.margin * typical and excess > 0.1 * mine["step_ms"]
            self.streak[r] = self.streak[r] + 1 if slow else 0
            if slow and self.streak[r] >= self.patience and r not in self.named:
                self.named.add(r)
                named.append(r)
                self.say(self._line(step, r, per_rank, typical))
            elif not slow and r in self.named:
                self.named.discard(r)
                self.say(f"step {step}: rank {r} ({self.hosts[r]}) keeps up with the others again")
        return named

    def _line(self, step: int, r: int, per_rank: list[dict], typical: float) -> str:
        mine = per_rank[r]
        excess = mine["own_ms"] - typical
        data_ms = mine["data_wait_share"] * mine["step_ms"]
        more_data = data_ms - OthersMedian([p["data_wait_share"] * p["step_ms"] for p in per_rank]).without(r)
        # a rank starved of CPU by another process waits on the run queue; one that waits on I/O does not
        more_queued = mine.get("cpu_wait_ms", math.nan) - OthersMedian(
            [p.get("cpu_wait_ms", math.nan) for p in per_rank]
        ).without(r)
        if more_queued >= excess / 2 and not more_data > more_queued:
            why = (
                f"it computes slowly: its thread waited {mine['cpu_wait_ms']:.0f} ms per step for a CPU that other "
                "processes held: look for another job on its host"
            )
        elif more_data >= excess / 2:
            why = (
                f"it waits on data ({100 * mine['data_wait_share']:.0f}% of its time): raise --num_workers, "
                "pre-encode the images, or look at its host's disk and network"
            )
        else:
            why = (
                f"it computes slowly (data wait {100 * mine['data_wait_share']:.0f}% of its time): look for "
                "another job on its host, a throttled device or a slow hook"
            )
        return (
            f"straggler at step {step}: rank {r} on {self.hosts[r]} spends {mine['own_ms']:.0f} ms per step on its "
            f"own vs {typical:.0f} ms for the others (median) for {self.streak[r]} log steps, and every rank waits "
            f"for it; {why}"
        )


class OthersMedian:
    """The median of every value but one, for each one in turn, from one sort (a straggler rule that compares each
    of thousands of ranks with the rest stays O(n log n) per log step)."""

    def __init__(self, values: list[float]):
        self.order = sorted(range(len(values)), key=values.__getitem__)
        self.position = {r: i for i, r in enumerate(self.order)}
        self.sorted = [values[r] for r in self.order]

    def without(self, r: int) -> float:
        i, n = self.position[r], len(self.sorted) - 1  # the others: the sorted values less position i

        def at(j: int) -> float:
            return self.sorted[j if j < i else j + 1]

        return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


class RankSummary:
    """Each rank's figures averaged over the run's log steps, printed to train.log at the end."""

    def __init__(self, hosts: list[str]):
        self.hosts = hosts
        self.sums: list[dict[str, float]] = [{} for _ in hosts]
        self.windows = 0

    def add(self, per_rank: list[dict]) -> None:
        self.windows += 1
        for sums, row in zip(self.sums, per_rank):
            for k, v in row.items():
                sums[k] = sums.get(k, 0.0) + v

    def lines(self) -> list[str]:
        if not self.windows:
            return []
        names = list(self.sums[0])
        width = max(len(h) for h in self.hosts)
        out = [f"per-rank summary over {self.windows} log steps (means):", f"rank {'host':<{width}} " + " ".join(
            f"{n:>15}" for n in names
        )]  # fmt: skip
        for r, sums in enumerate(self.sums):
            cells = " ".join(f"{_cell(n, sums[n] / self.windows):>15}" for n in names)
            out.append(f"{r:>4} {self.hosts[r]:<{width}} {cells}")
        return out


def _cell(name: str, value: float) -> str:
    return f"{100 * value:.1f}%" if name.endswith("share") else f"{value:.1f}"
