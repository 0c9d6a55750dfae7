"""Who stopped answering. Every rank counts heartbeats into the process group's store from a daemon thread; when a
collective times out (--dist_timeout), the ranks still running read the counters twice and name the ranks whose
count stood still, with their hosts. A process that is stopped (SIGSTOP), killed or whose host is gone stops
beating; a rank stuck elsewhere (a data worker, a deadlock) keeps beating and is told apart as "alive but not in
the collective". Counters, not clocks: the hosts' clocks need not agree."""

from __future__ import annotations

import datetime
import socket
import threading

import torch.distributed as dist

INTERVAL = 2.0  # seconds between heartbeats


class Heartbeat:
    def __init__(self, rank: int, world_size: int, timeout_s: float, store=None):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self._store = store or dist.distributed_c10d._get_default_store()
        self._store.set(f"dalle/host/{rank}", socket.gethostname())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="dalle-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(INTERVAL):
            try:
                self._store.add(f"dalle/beat/{self.rank}", 1)
            except Exception:  # the store's host is gone: the main thread's collective will say so
                return

    def close(self) -> None:
        """Stop beating and wait for the thread (at most one store call long), before the store goes away."""
        self._stop.set()
        self._thread.join(timeout=10)

    def explain(self, error: BaseException) -> str | None:
        """One line naming the ranks that stopped answering when `error` is a collective's timeout or a lost
        connection; None for other errors."""
        text = str(error)
        if not isinstance(error, (dist.DistError, RuntimeError)) or not any(
            s in text.lower() for s in ("timed out", "timeout", "connection closed", "connection reset")
        ):
            return None
        others = [r for r in range(self.world_size) if r != self.rank]
        try:
            self._store.set_timeout(datetime.timedelta(seconds=5 * INTERVAL))
            before = {r: self._count(r) for r in others}
            self._stop.wait(3 * INTERVAL)
            silent = [r for r in others if self._count(r) == before[r]]
            hosts = {r: self._store.get(f"dalle/host/{r}").decode() for r in silent}
        except Exception:  # the store lives in rank 0's process (or its launcher's): that is who is gone
            return (
                f"rank 0 (which holds the process group's store) did not answer within --dist_timeout "
                f"{self.timeout_s:g} s: it hung or its host is gone; the other ranks stop. Resume with --resume auto"
            )
        if not silent:
            return (
                f"a collective timed out after --dist_timeout {self.timeout_s:g} s although every rank still runs: "
                "one is stuck outside it (a data worker, a deadlock); the ranks stop. Resume with --resume auto"
            )
        named = ", ".join(f"rank {r} on {hosts[r]}" for r in silent)
        return (
            f"{named} did not answer within --dist_timeout {self.timeout_s:g} s (stopped, hung or its host is gone); "
            "the other ranks stop. Resume with --resume auto"
        )

    def _count(self, rank: int) -> int:
        # add(key, 0) reads a counter without waiting for it to exist (get() would wait)
        return self._store.add(f"dalle/beat/{rank}", 0)
