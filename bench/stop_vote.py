"""What the ranks' stop vote costs a step: 2 processes over Gloo run the same fixed work per step (a matmul chain
of about --work_ms, then an all_reduce of 256 KiB as DDP's gradients) with and without the vote
(training/signals.StopVote: an asynchronous sum of the SIGTERM flags started each step and read the next),
alternating blocks so that both see the same machine load.

    .venv/bin/python bench/stop_vote.py [--steps 400] [--work_ms 20]

Prints the step time of each and the vote's cost per step, in ms and as a fraction of the step.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dalle_pytorch.training.signals import StopFlag, StopVote  # noqa: E402
from distributed.torch_parts import ProcessGroup  # noqa: E402


class Ranks:
    """The two methods StopVote uses of a backend."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._group = ProcessGroup(world_size)  # its vote group, apart from the gradients' (as in training)

    def all_reduce_async(self, tensor, op="sum"):
        return self._group.all_reduce_async(tensor, op)


def run(rank: int, port: int, steps: int, work_ms: float, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    a = torch.randn(256, 256)
    t = time.perf_counter()
    for _ in range(20):
        a @ a
    per_mm = (time.perf_counter() - t) / 20
    reps = torch.tensor([max(1, round(work_ms / 1000 / per_mm))])
    dist.broadcast(reps, 0)  # both ranks do the same work per step: rank 0's count
    reps = int(reps)
    grads = torch.randn(256 * 256)
    flag, backend = StopFlag(), Ranks(2)
    times = {"without": [], "with": []}
    for _ in range(8):
        for mode in ("without", "with"):
            vote = StopVote(flag, backend) if mode == "with" else None
            dist.barrier()
            t = time.perf_counter()
            for _ in range(steps // 8):
                for _ in range(reps):
                    a @ a
                dist.all_reduce(grads)  # as DDP's gradient reduction: the ranks meet every step anyway
                if vote is not None:
                    assert not vote()
            if vote is not None:
                vote.close()
            times[mode].append((time.perf_counter() - t) / (steps // 8))
    if rank == 0:
        out.put({k: sorted(v)[len(v) // 2] for k, v in times.items()})
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--work_ms", type=float, default=20.0)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, port, args.steps, args.work_ms, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    result = out.get(timeout=600)
    for proc in procs:
        proc.join()
    without, with_vote = result["without"] * 1000, result["with"] * 1000
    print(f"2 ranks (Gloo), {args.steps} steps of about {args.work_ms:g} ms of work each, medians of 8 blocks")
    print(f"step without the vote: {without:.3f} ms")
    print(f"step with the vote:    {with_vote:.3f} ms")
    cost = with_vote - without
    print(f"the vote's cost per step: {cost:+.3f} ms ({cost / without * 100:+.2f}% of a step)")


if __name__ == "__main__":
    main()
