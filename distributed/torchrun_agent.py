"""torchrun as the sbatch files start it (`python -m distributed.torchrun_agent ARGS`, the same arguments): the
same launcher, but a SIGTERM to the agent (a preemption, `scontrol requeue`, the time limit's signal passed on)
reads as the expected event it is, one line, instead of torch's SignalException traceback in every requeued
job's log. The agent has already told its ranks to stop when the exception reaches us (they save and exit)."""

from __future__ import annotations

import signal
import socket
import sys


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        print(f"torchrun on {socket.gethostname()}: {name}, its ranks were told to save and stop", file=sys.stderr)
        raise SystemExit(128 + int(e.sigval)) from None


if __name__ == "__main__":
    main()
