"""What every trainer shares: the run's plan -> backend (and how the loop is recovered) -> run directory."""

from __future__ import annotations

import os
import secrets
import socket
from contextlib import contextmanager

import torch

from distributed import make_backend, set_threads

from ..data.build import TextTokenizerConfig, build_text_tokenizer
from .plan import RunPlan
from .run_dir import RunDir
from .signals import Stopped
from .trackers import open_trackers


class RanksLost(TimeoutError):
    """Ranks stopped answering (a hang, a lost host): the ones left stop; the scripts exit with
    --exit_code_on_hang (2 by default; a Kubernetes operator retries codes >= 128)."""


@contextmanager
def training_session(plan: RunPlan, default_name: str, configs: dict):
    """Set up the backend and the run directory; tear down on exit. Yields (backend, recovery, run).

    `plan`: what the run worked out (plan.py); `configs`: the sections of config.json."""
    cfg = plan.cfg
    backend = make_backend(plan.backend, plan.topo, plan.step_options(), **plan.backend_options)
    recovery = backend.recovery()
    if recovery.world_size_may_change:
        cfg.check_elastic()
    backend.setup()
    set_threads(cfg.threads, backend.topo)
    torch.manual_seed(cfg.seed)
    status, run = "FAILED", None  # how the run ended, for MLflow
    try:
        run = RunDir(
            RunDir.path_of(cfg, default_name),
            backend.is_main,
            lambda path, continue_run, say: open_trackers(cfg, path, continue_run, say),
            resumed=bool(cfg.resume),
        )
        if not recovery.world_size_may_change:  # an elastic joiner meets no startup collective (see below)
            check_shared_storage(backend, run.path)
        run.record(configs, plan.backend_options, plan.derived(backend.world_size))
        try:
            yield backend, recovery, run
        except Stopped:  # SIGTERM: every rank saved at the same step and leaves together, as on success
            status = "KILLED"
            backend.barrier()
            raise
        except Exception as e:  # a collective that timed out: name the ranks that stopped answering
            why = backend.explain(e)
            if why is None:
                raise
            run.print(f"error: {why}")
            raise RanksLost(why) from e
        # on success, no rank leaves the group while a peer may still be in a collective: a peer whose
        # connection closes mid-collective aborts (seen as a rare exit -6 under deepspeed ZeRO-3)
        backend.barrier()
        status = "FINISHED"
    finally:
        try:
            if run is not None:
                run.close(status)
        finally:
            backend.teardown()


def add_up(backend, counts: list[int]) -> list[int]:
    """Collective: the sum of every rank's `counts`."""
    total = backend.all_reduce(torch.tensor(counts, dtype=torch.int64, device=backend.device), op="sum")
    return [int(n) for n in total.tolist()]


def shared_text_tokenizer(text: TextTokenizerConfig, cfg, backend, recovery, run, dataset, lowercase: bool = True):
    """The text tokenizer `text` chooses; the run's own BPE is trained on rank 0 and sent to every rank.
    `lowercase`: build_text_tokenizer's."""

    def share(words: str | None) -> str:
        if not recovery.world_size_may_change:
            return share_text(backend, words)
        # elastic: a worker that joins later finds the others training, with no collective of theirs to meet;
        # it reads the file rank 0 wrote (Horovod's barrier lets a joining worker through)
        backend.barrier()
        with open(os.path.join(run.path, "bpe.yttm")) as f:
            return f.read()

    resuming = bool(cfg.resume)
    return build_text_tokenizer(text, run.path, dataset, resuming, backend.is_main, share, run.print, lowercase)


def share_text(backend, text: str | None) -> str:
    """Rank 0's `text` on every rank, through the process group: its length, then its bytes, each a sum to
    which only rank 0 adds (every backend has all_reduce; nothing goes through the disk)."""
    data = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if backend.is_main else None
    size = torch.tensor([len(data) if backend.is_main else 0], dtype=torch.int64, device=backend.device)
    buf = torch.zeros(int(backend.all_reduce(size, op="sum").item()), dtype=torch.int32, device=backend.device)
    if backend.is_main:
        buf.copy_(data)
    return bytes(backend.all_reduce(buf, op="sum").to(torch.uint8).tolist()).decode()


def check_shared_storage(backend, run_path: str) -> None:
    """Every rank writes its part of each checkpoint into the run directory and reads the whole back on resume,
    so every host must see what rank 0 writes there: checked at start, with one line naming who does not."""
    if backend.world_size == 1:
        return
    marker = os.path.join(run_path, ".shared-storage-check")
    token = secrets.token_hex(8) if backend.is_main else None
    if backend.is_main:
        with open(marker, "w") as f:
            f.write(token)
    token = share_text(backend, token)  # a collective: rank 0 wrote the file before any rank reads it
    where = share_text(backend, socket.gethostname())
    try:
        with open(marker) as f:
            seen = f.read() == token
    except OSError:
        seen = False
    blind = backend.all_gather(torch.tensor([0 if seen else 1], device=backend.device))
    if backend.is_main:
        os.remove(marker)
    if blind.any():
        ranks = ", ".join(str(r) for r in blind.nonzero().flatten().tolist())
        raise FileNotFoundError(
            f"rank {ranks} cannot see {run_path}, which rank 0 wrote on {where}: --output_dir must be on storage "
            "every host sees (a shared filesystem: NFS, Lustre, ...), since every rank writes its part of each "
            "checkpoint there and reads the whole back on resume"
        )
