"""Where this process sits, as whichever launcher started it describes it (torchrun, the deepspeed launcher,
horovodrun, mpirun, SLURM, or a hand-made torch.distributed environment), and the backend that matches."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

BACKENDS = ("auto", "single", "ddp", "fsdp", "deepspeed", "horovod")


@dataclass(frozen=True)
class Topology:
    """Where this process sits, as the launcher described it."""

    launcher: str  # none, torchrun, deepspeed, horovod, mpi, slurm
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500


def _int(env, *names, default=0) -> int:
    for n in names:
        if n in env and env[n] != "":
            return int(env[n])
    return default


def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM nodelist: 'gpu[01-04,07],cpu1' -> 'gpu01'."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not m:
        return "127.0.0.1"
    prefix, _, ranges = m.groups()
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "")


def topology_from_env(env: dict | None = None) -> Topology:
    """Read rank, world size, local rank, node and master address from the launcher's variables."""
    env = dict(os.environ if env is None else env)
    port = _int(env, "MASTER_PORT", default=29500)
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    if "HOROVOD_RANK" in env:
        return Topology(
            "horovod",
            _int(env, "HOROVOD_RANK"),
            _int(env, "HOROVOD_SIZE", default=1),
            _int(env, "HOROVOD_LOCAL_RANK"),
            _int(env, "HOROVOD_LOCAL_SIZE", default=1),
            _int(env, "HOROVOD_CROSS_RANK"),
            env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", addr),
            port,
        )
    if "TORCHELASTIC_RUN_ID" in env or "GROUP_RANK" in env:
        return Topology(
            "torchrun",
            _int(env, "RANK"),
            _int(env, "WORLD_SIZE", default=1),
            _int(env, "LOCAL_RANK"),
            _int(env, "LOCAL_WORLD_SIZE", default=1),
            _int(env, "GROUP_RANK"),
            addr,
            port,
        )
    if "CROSS_RANK" in env and "RANK" in env:  # the deepspeed launcher
        return Topology(
            "deepspeed",
            _int(env, "RANK"),
            _int(env, "WORLD_SIZE", default=1),
            _int(env, "LOCAL_RANK"),
            _int(env, "LOCAL_SIZE", default=1),
            _int(env, "CROSS_RANK"),
            addr,
            port,
        )
    if "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env:
        return Topology(
            "mpi",
            _int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK"),
            _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", default=1),
            _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"),
            _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", default=1),
            _int(env, "OMPI_COMM_WORLD_NODE_RANK"),
            addr,
            port,
        )
    if "SLURM_PROCID" in env and _int(env, "SLURM_NTASKS", default=1) > 1:
        return Topology(
            "slurm",
            _int(env, "SLURM_PROCID"),
            _int(env, "SLURM_NTASKS", default=1),
            _int(env, "SLURM_LOCALID"),
            _int(env, "SLURM_NTASKS_PER_NODE", default=1) if env.get("SLURM_NTASKS_PER_NODE", "").isdigit() else 1,
            _int(env, "SLURM_NODEID"),
            env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")),
            port,
        )
    if _int(env, "WORLD_SIZE", default=1) > 1:  # a hand-made torch.distributed environment
        return Topology(
            "torchrun",
            _int(env, "RANK"),
            _int(env, "WORLD_SIZE"),
            _int(env, "LOCAL_RANK"),
            _int(env, "LOCAL_WORLD_SIZE", default=1),
            0,
            addr,
            port,
        )
    return Topology("none")


def resolve_backend(requested: str, topo: Topology) -> str:
    """The backend to use: the requested one, or for 'auto' the one that matches the launcher."""
    if requested not in BACKENDS:
        raise ValueError(f"--distributed_backend must be one of {', '.join(BACKENDS)} (got {requested!r})")
    if requested != "auto":
        if requested == "single" and topo.world_size > 1:
            raise ValueError(
                f"--distributed_backend single under a {topo.launcher} launch of {topo.world_size} processes would "
                "train N unsynchronized copies: use ddp, fsdp, deepspeed or horovod"
            )
        return requested
    return {"none": "single", "torchrun": "ddp", "slurm": "ddp", "deepspeed": "deepspeed", "horovod": "horovod"}.get(
        topo.launcher, "horovod" if topo.launcher == "mpi" else "single"
    )


def pick_device(local_rank: int) -> torch.device:
    """This process's GPU (local rank modulo the GPUs on the node), or the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_threads(threads: int, topo: Topology) -> None:
    """Split the CPU cores among the local ranks so they do not oversubscribe the machine (0: automatic)."""
    if threads <= 0:
        threads = max(1, (os.cpu_count() or 1) // max(topo.local_world_size, 1))
    torch.set_num_threads(threads)
