"""SIGTERM (a preempted node, a scheduler's time limit, `scontrol requeue`) as a flag, and the ranks' vote on
it: every rank stops at the same step, at most one step after the first signal, and no step waits for the vote."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading

import torch


class Stopped(Exception):
    """The run stopped on SIGTERM before its last step, its checkpoint and export saved: it resumes with --resume
    auto. The scripts exit with --exit_code_on_stop (0 by default; a Kubernetes operator retries codes >= 128)."""

    def __init__(self, step: int, export_path: str):
        super().__init__(f"stopped on SIGTERM at step {step}")
        self.step, self.export_path = step, export_path


class StopFlag:
    """Set by SIGTERM, or by a hook's request (training/hooks.py); `reason` says which, for the log."""

    def __init__(self):
        self.set = False
        self.reason = ""

    def request(self, reason: str) -> None:
        self.set, self.reason = True, self.reason or reason

    def __enter__(self) -> StopFlag:
        # Only the main thread may take a signal. Ray Train runs the loop in a thread of its worker process, and
        # stops a worker by ending the actor, not with SIGTERM: there the flag is set by hooks alone.
        self._main = threading.current_thread() is threading.main_thread()
        if self._main:
            self._old = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, *_):
        self.request("SIGTERM")

    def __exit__(self, *exc) -> None:
        if self._main:
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
        flags = torch.tensor([float(self.flag.set), float(self.flag.reason == "SIGTERM")])
        self._pending = self.backend.all_reduce_async(flags, "sum")
        if previous is None:
            return False
        stop, signalled = previous().tolist()
        if signalled:  # a rank was signalled: SIGTERM is every rank's reason, so that every rank exits alike
            self.flag.set, self.flag.reason = True, "SIGTERM"
        elif stop and not self.flag.set:
            self.flag.request("a stop requested on another rank")
        return stop > 0

    def close(self) -> None:
        """Wait for the vote still under way, so that no rank leaves while a peer's is pending."""
        if self._pending is not None:
            self._pending()
            self._pending = None


class GraceCheck:
    """Says once, on rank 0, when a SIGTERM's save cannot fit in SLURM's grace period (KillWait: the seconds
    between SIGTERM and SIGKILL): stopping takes up to two steps (the vote is read a step late) and a checkpoint,
    both measured in this run. Outside SLURM, or where scontrol does not say, it stays silent."""

    def __init__(self, log, is_main: bool, env=os.environ):
        self.log = log
        self.grace_s = slurm_kill_wait() if is_main and "SLURM_JOB_ID" in env else None
        self.step_s = self.save_s = None

    def saved(self, seconds: float) -> None:
        self.save_s = max(self.save_s or 0.0, seconds)
        self._check()

    def stepped(self, seconds_per_step: float) -> None:
        self.step_s = seconds_per_step
        self._check()

    def _check(self) -> None:
        if self.grace_s is None or self.step_s is None or self.save_s is None:
            return
        need = 2 * self.step_s + self.save_s
        if need > self.grace_s:
            self.log(
                f"warning: a step takes {self.step_s:.1f} s and a checkpoint {self.save_s:.1f} s, so saving on SIGTERM "
                f"needs up to {need:.0f} s, more than SLURM gives before SIGKILL (KillWait {self.grace_s:.0f} s): a "
                "preempted job would lose the steps since its last checkpoint; ask for a longer KillWait (or "
                "GraceTime), or save more often with --save_every_n_steps"
            )
        self.grace_s = None  # once


def slurm_kill_wait() -> float | None:
    """SLURM's KillWait in seconds, from `scontrol show config`; None when scontrol is absent or silent."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"^KillWait\s*=\s*(\d+)\s*sec", out, re.MULTILINE)
    return float(match.group(1)) if match else None
