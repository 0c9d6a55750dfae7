"""Command-line flags -> typed configs, and the process topology read from whichever launcher started us.

Every run flag is a dataclass field with a default and a help text; `parse(argv, *configs)` builds the
parser from the dataclasses so the flags, the defaults and `config.json` cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass

from dalle_pytorch.config_utils import flag

BACKENDS = ("auto", "single", "ddp", "fsdp", "deepspeed", "horovod")
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class TrainConfig:
    """What every trainer shares: data, optimisation, precision, distribution, outputs."""

    # data
    dataset_size: int = flag(20000, "samples in the built-in synthetic dataset (used when no data is given)")
    num_workers: int = flag(2, "DataLoader worker processes per rank")
    # length of training
    epochs: int = flag(1, "passes over the data (ignored when --steps is set)")
    steps: int = flag(0, "optimizer steps to train; 0 means derive from --epochs")
    batch_size: int = flag(32, "micro-batch size per process")
    global_batch_size: int = flag(
        0,
        "samples per optimizer step over all processes; accumulation makes up the difference (0: none)",
    )
    # optimisation
    learning_rate: float = flag(1e-3, "peak learning rate (never rescaled by world size)")
    lr_decay: str = flag(
        "cosine", "learning-rate decay after warmup", choices=("cosine", "exponential", "linear", "constant")
    )
    lr_min_factor: float = flag(0.1, "final learning rate as a fraction of --learning_rate")
    warmup_steps: int = flag(0, "linear learning-rate warmup steps")
    weight_decay: float = flag(0.0, "AdamW weight decay (never applied to norms, biases and embeddings)")
    clip_grad_norm: float = flag(1.0, "clip the global gradient norm to this; 0 disables clipping")
    precision: str = flag("fp32", "numeric precision of the trained model", choices=PRECISIONS)
    compile: bool = flag(False, "torch.compile the trained model (the first steps are slow while it compiles)")
    seed: int = flag(42, "random seed (data order, initialization, sampling)")
    # distribution
    distributed_backend: str = flag("auto", "auto picks from the launcher", choices=BACKENDS)
    threads: int = flag(0, "torch CPU threads per process; 0 splits the cores among local ranks")
    # DeepSpeed
    zero_stage: str = flag(
        "auto", "DeepSpeed ZeRO stage; auto picks the lowest that fits in memory", choices=("auto", "0", "1", "2", "3")
    )
    offload_optimizer: bool = flag(False, "DeepSpeed: keep optimizer states in CPU memory")
    offload_params: bool = flag(False, "DeepSpeed ZeRO-3: keep parameters in CPU memory")
    deepspeed_config: str = flag("", "a DeepSpeed JSON config; our flags fill only what it leaves out")
    initial_scale_power: int = flag(16, "fp16 dynamic loss scale starts at 2**N")
    loss_scale_window: int = flag(1000, "fp16: steps without overflow before the loss scale grows")
    hysteresis: int = flag(2, "fp16 (DeepSpeed): overflows tolerated before the loss scale drops")
    min_loss_scale: float = flag(1.0, "fp16: the loss scale never drops below this")
    # Horovod
    horovod_compression: str = flag("none", "Horovod gradient compression for the allreduce", choices=("none", "fp16"))
    commit_every: int = flag(
        10, "Horovod elastic: steps between in-memory state commits; a lost worker costs at most this many steps"
    )
    # outputs
    output_dir: str = flag("runs", "parent folder of run directories")
    name: str = flag("", "run directory name under --output_dir (default: the trainer's name)")
    log_every: int = flag(10, "log metrics every N optimizer steps")
    sample_every: int = flag(200, "write sample image grids every N steps; 0 disables")
    save_every_n_steps: int = flag(500, "write a resume checkpoint every N steps; 0 only at the end")
    keep_n_checkpoints: int = flag(2, "resume checkpoints to keep (older ones are deleted after a new one is complete)")
    resume: str = flag("", "resume from a checkpoint directory, or 'auto' for the newest complete one in the run")
    tensorboard: bool = flag(True, "write TensorBoard event files into the run directory")
    wandb: bool = flag(False, "log to Weights & Biases too (offline unless WANDB_MODE says otherwise)")
    wandb_project: str = flag("dalle-pytorch", "Weights & Biases project")
    quiet: bool = flag(False, "no progress bar")
    debug: bool = flag(False, "show Python tracebacks for user errors")

    def validate(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"--batch_size must be at least 1 (got {self.batch_size})")
        if self.steps < 0 or self.epochs < 1 and self.steps == 0:
            raise ValueError("set --steps to a positive count or --epochs to at least 1")
        if self.learning_rate <= 0:
            raise ValueError(f"--learning_rate must be positive (got {self.learning_rate})")
        if self.clip_grad_norm < 0:
            raise ValueError(f"--clip_grad_norm must be >= 0 (got {self.clip_grad_norm})")

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-batches per optimizer step so that batch_size x world_size x steps == global_batch_size."""
        if self.global_batch_size == 0:
            return 1
        per_step = self.batch_size * world_size
        if self.global_batch_size % per_step:
            raise ValueError(
                f"--global_batch_size {self.global_batch_size} is not a multiple of --batch_size x world size "
                f"= {self.batch_size} x {world_size} = {per_step}: change one of them"
            )
        return self.global_batch_size // per_step


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


# ----------------------------------------------------------------------------------------------- parsing


def _add_fields(parser: argparse.ArgumentParser, cls, title: str) -> None:
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kw = {"help": f"{f.metadata['help']} (default: {default})", "default": default}
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        if isinstance(default, bool):
            kw["action"] = argparse.BooleanOptionalAction
        elif isinstance(default, (list, tuple)):
            kw["nargs"] = "+"
            kw["type"] = type(default[0]) if default else str
        elif default is not None:
            kw["type"] = type(default)
        else:
            kw["type"] = str
        group.add_argument(f"--{f.name}", **kw)


def build_parser(description: str, *configs: tuple[type, str], extra=None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed
    for cls, title in configs:
        _add_fields(parser, cls, title)
    if extra:
        extra(parser)
    return parser


def take(ns: argparse.Namespace, cls):
    """The dataclass `cls` filled from the parsed flags that name its fields."""
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)})
