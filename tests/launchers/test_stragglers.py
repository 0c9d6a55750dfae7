"""A slow rank named under the real launchers: train_dalle.py on 2 local ranks under torchrun (DDP, FSDP),
deepspeed (ZeRO-2) and horovodrun, rank 1 slowed by 0.3 s per step in turn in its before_step hook, its after_step
hook, its data and by a CPU hog beside it (straggler_hooks.py), with balanced steps between. Each slowing must name
rank 1 with its host within --straggler_patience log steps, say whether it waits on data or computes slowly, and say
when it keeps up again; a balanced step names no one. (The rule on made-up figures and forked ranks:
tests/training/test_rank_stats.py.)"""

from __future__ import annotations

import json
import os
import re
import socket

import pytest
import straggler_hooks as plan
from launch import dalle_args, launch

PATIENCE = 3  # --straggler_patience's default
# The rule's default margin is 25%: on this 2-vCPU virtual machine the two ranks' own times differ by up to 53% in
# steps where nothing is slowed (a vCPU slower for a whole run, the helper threads of both ranks landing on one core),
# and under horovodrun by up to 2.3x: its driver's and Horovod's threads hold about 40% of one core (rank 1's
# run-queue wait 22-33 ms per 60 ms step with nothing slowed, in two fresh-clone runs). That is real, but not what
# these cases test: each slowing here is 4x or more (5 busy processes leave rank 1 a sixth of its core), so a margin
# of 200% keeps the machine's spread out of the check without hiding any of them.
MARGIN = 2.0
BATCH = 64  # steps long enough (about 20 ms of own work) that busy processes on its core slow a rank's work rather
# than only delay its start (Linux lets a thread that woke from a wait run a few ms first)
WHY = {
    "before_step": "computes slowly (data wait",
    "after_step": "computes slowly (data wait",
    "data": "waits on data",
    "hog": "computes slowly: its thread waited",  # ... ms per step for a CPU that other processes held
}

CASES = [
    ("torchrun", ["--distributed_backend", "ddp"]),
    ("torchrun-fsdp", ["--distributed_backend", "fsdp"]),
    ("deepspeed", ["--zero_stage", "2"]),
    ("horovod", []),
]


@pytest.mark.parametrize("kind,extra", CASES, ids=["ddp", "fsdp", "deepspeed-2", "horovod"])
def test_a_slowed_rank_is_named_with_its_host_and_why(kind, extra, vae_path, tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the CPU hog needs rank 1 on a core of its own")
    args = dalle_args(vae_path, str(tmp_path), batch=BATCH, steps=plan.STEPS, extra=extra)
    args += ["--log_every", str(plan.LOG_EVERY), "--sample_every", "0", "--save_every_n_steps", "0"]
    args += ["--straggler_margin", str(MARGIN)]
    args += ["--hooks", f"{plan.__file__}:SlowRank1"]
    launch(kind, "train_dalle.py", args)
    log = open(os.path.join(tmp_path, "dalle", "train.log")).read()
    named = [
        (int(step), int(rank), host, why)
        for step, rank, host, why in re.findall(
            r"straggler at step (\d+): rank (\d) on (\S+) .* every rank waits for it; it (.*)", log
        )
    ]
    caught_up = [int(s) for s in re.findall(r"step (\d+): rank 1 \(\S+\) keeps up with the others again", log)]
    table = "\n".join(line for line in log.splitlines() if "straggler" in line or "keeps up" in line or "rank" in line)
    table += "\nper log step: own_ms / cpu_wait_ms of rank 0, rank 1\n" + per_log_step(tmp_path)
    expected = []
    for way, (first, last) in plan.PHASES.items():
        at = [n for n in named if first <= n[0] <= last]
        assert len(at) == 1, f"{way} (steps {first}-{last}) named {at}:\n{table}"
        step, rank, host, why = at[0]
        within = first - 1 + (PATIENCE + settling(kind, way)) * plan.LOG_EVERY  # the end of the third slowed log step
        assert (rank, host) == (1, socket.gethostname()) and why.startswith(WHY[way]), f"{way}:\n{table}"
        assert step <= within, f"{way}: named after step {within}:\n{table}"
        # caught up at the first or second log step after the slowing: after the busy processes end, the threads that
        # float between the 2 cores (Horovod's and Gloo's, the launcher's) take a log step to spread out again
        # (seen once under horovodrun: rank 1's run-queue wait 27 ms per step in the first window, 14 ms in the next)
        again = next((s for s in caught_up if s > step), None)
        assert again and last < again <= last + 2 * plan.LOG_EVERY, f"{way}: no catching up:\n{table}"
        expected.append(at[0])
    assert named == expected, f"a rank named outside the slowed steps:\n{table}"


def settling(kind: str, way: str) -> int:
    """Log steps the machine takes to settle when the hog starts under horovodrun: rank 1's Horovod threads are
    free (see straggler_hooks.py), and when 5 busy processes take its core they move to the other, where rank 0 then
    waits for a CPU too (seen in the fresh-clone suite at 1aa83fe: rank 0's run-queue wait 58 and 54 ms per step
    in the hog's first two log steps, 5-17 ms otherwise; its own time 74 ms against 21-35, which put rank 1's 221
    ms one ms under the 3x the rule asks; named at its next 3 slowed log steps). On a host with a core for each
    rank's threads rank 0 would not slow; one log step more is given to that case only."""
    return 1 if kind == "horovod" and way == "hog" else 0


def per_log_step(run: str) -> str:
    """Each log step's own and run-queue times of both ranks, from metrics.jsonl: what a failure needs to be read."""
    lines = []
    for line in open(os.path.join(run, "dalle", "metrics.jsonl")):
        m = json.loads(line)
        figures = [f"{m.get(f'rank{r}/own_ms', 0):.0f}/{m.get(f'rank{r}/cpu_wait_ms', 0):.0f}" for r in (0, 1)]
        lines.append(f"  step {m['step']}: " + ", ".join(figures))
    return "\n".join(lines)
