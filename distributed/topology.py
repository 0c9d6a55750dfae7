"""Where this process sits, as whichever launcher started it describes it (torchrun, the deepspeed launcher,
horovodrun, mpirun, SLURM, or a hand-made torch.distributed environment), and the backend that matches."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import socket
import subprocess
from dataclasses import dataclass

import torch

BACKENDS = ("auto", "single", "ddp", "fsdp", "deepspeed", "horovod")


@dataclass(frozen=True)
class Topology:
    """Where this process sits, as the launcher described it."""

    launcher: str  # none, torchrun, deepspeed, horovod, mpi, slurm, ray, kubeflow
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


def slurm_hostnames(nodelist: str) -> list[str]:
    """Every host of a SLURM hostlist, in order: 'gpu[07-08,10],a1' -> ['gpu07', 'gpu08', 'gpu10', 'a1']."""
    # scontrol is SLURM's own parser, so it reads the list as the SLURM that wrote it; it needs a SLURM config
    # (a job has one) but no running slurmctld. SLURM 22.05 rejects a suffix after a range ('node[1-4]-ib'),
    # printing "Invalid hostlist" on stderr with exit status 0, and fails without a config: python-hostlist
    # (the same grammar, suffixes included) reads the list then. It answers at once, but retries for 60 s
    # when SLURM_CONF names a missing file: hence the timeout.
    if shutil.which("scontrol"):
        try:
            r = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10)
            if r.returncode == 0 and r.stdout.split():
                return r.stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        import hostlist
    except ImportError:
        raise ImportError(
            f"reading the SLURM nodelist {nodelist!r} needs scontrol or python-hostlist: run `make install`"
        ) from None
    try:
        return hostlist.expand_hostlist(nodelist)
    except hostlist.BadHostlist as e:
        raise ValueError(f"{nodelist!r} is not a SLURM hostlist ({e}): set MASTER_ADDR to the first host") from None


def _slurm_counts(spec: str) -> list[int]:
    """SLURM's compressed per-node task counts, one per node: '2(x3),1' -> [2, 2, 2, 1]; '' -> [] (SLURM left
    the variable empty). python-hostlist's parser, SLURM's grammar."""
    if not spec.strip():
        return []
    import hostlist

    try:
        return hostlist.parse_slurm_tasks_per_node(spec)
    except hostlist.BadHostlist:
        raise ValueError(
            f"{spec!r} is not a SLURM task count list (like '2(x3),1'): check SLURM_STEP_TASKS_PER_NODE and "
            "SLURM_TASKS_PER_NODE (srun sets them)"
        ) from None


def _slurm_local_world_size(env: dict) -> int:
    """The number of tasks on this node (SLURM_NODEID) under srun."""
    node = _int(env, "SLURM_NODEID")
    # The step's counts are exact inside srun (a step may use part of the job's nodes or tasks); the job's
    # come next. SLURM_NTASKS_PER_NODE is the --ntasks-per-node request: one number for every node.
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        counts = _slurm_counts(env.get(name, ""))
        if len(counts) == 1 or node < len(counts):
            return counts[min(node, len(counts) - 1)]
    nodes = _int(env, "SLURM_NNODES")
    return max(1, _int(env, "SLURM_NTASKS", default=1) // nodes) if nodes else 1


@functools.cache  # a collective: each rank runs it once, however often the topology is read
def _mpi_master_addr() -> str:
    """Rank 0's host name, broadcast to every rank of an mpirun launch (every rank must call this)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise ValueError(
            "under mpirun across hosts, pass the first host's address: "
            "`mpirun -x MASTER_ADDR=<first host> -x MASTER_PORT=29500 ...` (or install mpi4py)"
        ) from None
    return MPI.COMM_WORLD.bcast(socket.gethostname(), root=0)


def topology_from_env(env: dict | None = None) -> Topology:
    """Read rank, world size, local rank, node and master address from the launcher's variables."""
    env = dict(os.environ if env is None else env)
    port = _int(env, "MASTER_PORT", default=29500)
    addr = env.get("MASTER_ADDR") or "127.0.0.1"
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
    if env.get("DALLE_LAUNCHER") == "ray":  # a Ray Train worker (distributed/ray_launcher.py): Ray set the rest
        return _torch_variables("ray", env, _int(env, "NODE_RANK"), addr, port)
    if "TORCHELASTIC_RUN_ID" in env or "GROUP_RANK" in env:
        return _torch_variables("torchrun", env, _int(env, "GROUP_RANK"), addr, port)
    if "CROSS_RANK" in env and "RANK" in env:  # the deepspeed launcher
        return _torch_variables("deepspeed", env, _int(env, "CROSS_RANK"), addr, port, local_size="LOCAL_SIZE")
    if "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env:  # Open MPI, or MPICH / Intel MPI (hydra)
        rank = _int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK")
        world = _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", default=1)
        local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", default=1)
        if not env.get("MASTER_ADDR") and world > local_world:  # several hosts: 127.0.0.1 is not rank 0's
            addr = _mpi_master_addr()
        # OMPI_COMM_WORLD_NODE_RANK is not the node's index but this process's rank on its node across all jobs
        # (docs.open-mpi.org, "Environment variables set for MPI applications"). mpirun's default --map-by slot
        # fills each host before the next, so with equal hosts the node is rank // local world size.
        return Topology(
            "mpi",
            rank,
            world,
            _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"),
            local_world,
            rank // max(local_world, 1),
            addr,
            port,
        )
    if "SLURM_PROCID" in env and _int(env, "SLURM_NTASKS", default=1) > 1:  # srun, one task per rank
        # rank 0 runs on the step's first node, which need not be the job's first
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        return Topology(
            "slurm",
            _int(env, "SLURM_PROCID"),
            _int(env, "SLURM_NTASKS", default=1),
            _int(env, "SLURM_LOCALID"),
            _slurm_local_world_size(env),
            _int(env, "SLURM_NODEID"),
            env.get("MASTER_ADDR") or (slurm_hostnames(nodelist)[0] if nodelist else "127.0.0.1"),
            port,
        )
    if "PET_NNODES" in env and "RANK" not in env:  # a Kubeflow pod running the script itself (no torchrun)
        return _kubeflow_pod(env)
    if _int(env, "WORLD_SIZE", default=1) > 1:  # a hand-made torch.distributed environment
        return _torch_variables("torchrun", env, 0, addr, port)
    return Topology("none")


def _torch_variables(launcher: str, env: dict, node: int, addr: str, port: int, local_size="LOCAL_WORLD_SIZE"):
    """The ranks as torch.distributed's variables give them (RANK, WORLD_SIZE, LOCAL_RANK and the local size),
    which torchrun, the deepspeed launcher and Ray Train all set; each names the node in its own."""
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE", default=1)
    return Topology(launcher, rank, world, _int(env, "LOCAL_RANK"), _int(env, local_size, default=1), node, addr, port)


def _kubeflow_pod(env: dict) -> Topology:
    """One rank per pod, from what Kubeflow's operator sets for torchrun (PET_NNODES, PET_NODE_RANK,
    PET_MASTER_ADDR, PET_MASTER_PORT, PET_NPROC_PER_NODE): the pod's command is `python SCRIPT`, not torchrun."""
    nnodes, nproc = env["PET_NNODES"], env.get("PET_NPROC_PER_NODE", "1")
    one_device = nproc in ("auto", "gpu") and torch.cuda.is_available() and torch.cuda.device_count() == 1
    if ":" in nnodes or not (nproc == "1" or one_device):
        raise ValueError(
            f"this pod is asked for {nproc} processes per node on {nnodes} nodes (PET_NPROC_PER_NODE, PET_NNODES): "
            "start the script with torchrun, which reads them (`torchrun train_dalle.py ...`, "
            "examples/kubernetes/pytorchjob.yaml), or set numProcPerNode to 1"
        )
    return Topology(
        "kubeflow",
        _int(env, "PET_NODE_RANK"),
        int(nnodes),
        0,
        1,
        _int(env, "PET_NODE_RANK"),
        env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR") or "127.0.0.1",
        _int(env, "PET_MASTER_PORT", "MASTER_PORT", default=29500),
    )


def _horovod_has_mpi() -> bool:
    """Whether horovod is installed with MPI, so that processes mpirun started can join it."""
    try:
        import horovod.torch as hvd
    except ImportError:
        return False
    return bool(hvd.mpi_built())


def resolve_backend(requested: str, topo: Topology) -> str:
    """The backend to use: the requested one, or for 'auto' the one that matches the launcher and can start."""
    if requested not in BACKENDS:
        raise ValueError(f"--distributed_backend must be one of {', '.join(BACKENDS)} (got {requested!r})")
    if requested == "single" and topo.world_size > 1:
        raise ValueError(
            f"--distributed_backend single under a {topo.launcher} launch of {topo.world_size} processes would "
            "train N unsynchronized copies: use ddp, fsdp, deepspeed or horovod"
        )
    # A horovod without MPI cannot join processes that mpirun started. Without horovod at all, the backend's
    # own import error says how to install it.
    if (
        requested == "horovod"
        and topo.launcher == "mpi"
        and importlib.util.find_spec("horovod")
        and not _horovod_has_mpi()
    ):
        raise ValueError(
            "Horovod here is built with Gloo only, which mpirun cannot start: launch with "
            "`horovodrun --gloo -np N -H hostA:n,hostB:n python ...`, "
            "or use --distributed_backend ddp (or deepspeed) under mpirun"
        )
    if requested != "auto":
        return requested
    if topo.launcher == "mpi":
        return "horovod" if _horovod_has_mpi() else "ddp"
    by_launcher = {"deepspeed": "deepspeed", "horovod": "horovod", "none": "single"}
    return by_launcher.get(topo.launcher, "ddp")  # torchrun, slurm, ray, kubeflow


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
