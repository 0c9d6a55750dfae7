"""torchrun as the sbatch files start it (`python -m distributed.torchrun_agent ARGS`, the same arguments): the
same launcher, but a SIGTERM to the agent (a preemption, `scontrol requeue`, the time limit's signal passed on)
reads as the expected event it is, one line, instead of torch's SignalException traceback in every requeued
job's log. The agent has already told its ranks to stop when the exception reaches us (they save and exit).

Its exit status is the ranks' when they stopped with a status >= 128 (--exit_code_on_stop 143, --exit_code_on_hang
142, or a signal: -9 reads 137), instead of torchrun's 1 for any failure: a Kubernetes operator whose restart
policy is ExitCode retries those (examples/kubernetes/) and gives up on the others (a bad flag)."""

from __future__ import annotations

import signal
import socket
import sys


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        print(f"torchrun on {socket.gethostname()}: {name}, its ranks were told to save and stop", file=sys.stderr)
        raise SystemExit(128 + int(e.sigval)) from None
    except ChildFailedError as e:  # torchrun has printed which ranks failed and how
        raise SystemExit(retryable_status([f.exitcode for f in e.failures.values()])) from None


def retryable_status(exitcodes: list[int]) -> int:
    """The first status >= 128 among the ranks' (a signal -N as 128 + N), else 1 as torchrun would."""
    statuses = [128 - c if c < 0 else c for c in exitcodes]
    return next((s for s in statuses if s >= 128), 1)


if __name__ == "__main__":
    main()
