"""One Backend interface, one file per backend. `make_backend` picks and builds one lazily, so that heavy
optional packages (deepspeed, horovod) are imported only when asked for; each backend's `recovery()` says
how the loop is run (once, or again after workers were lost or added); `read_weights` reads any backend's
checkpoint."""

from __future__ import annotations

import dataclasses

from .base import Backend, Recovery, StepOptions, StepResult, Workload
from .deepspeed_config import DeepSpeedOptions
from .horovod_config import HorovodOptions
from .topology import BACKENDS, Topology, resolve_backend, set_threads, topology_from_env

# each backend's own flags: the scripts add them to their parser and pass them back by backend name
BACKEND_OPTIONS = {"deepspeed": DeepSpeedOptions, "horovod": HorovodOptions}
# how to get the backend whose flag was given
_HOW = {
    "deepspeed": "launch with `deepspeed SCRIPT ...` or pass --distributed_backend deepspeed",
    "horovod": "launch with `horovodrun -np N python SCRIPT ...`",
}


def applicable_options(name: str, options: dict) -> dict:
    """The options of backend `name` alone (what the run records), after refusing in one line any other
    backend's flag set away from its default: it would do nothing here (`torchrun ... --zero_stage 3` trains
    plain DDP replicas)."""
    for owner, opts in options.items():
        if owner == name:
            continue
        default = type(opts)()
        for f in dataclasses.fields(opts):
            if getattr(opts, f.name) != getattr(default, f.name):
                raise ValueError(
                    f"--{f.name} is a {owner} flag, but this run's backend is {name}: drop it, or {_HOW[owner]}"
                )
    return {owner: opts for owner, opts in options.items() if owner == name}


def make_backend(
    name: str,
    topo: Topology,
    opts: StepOptions = StepOptions(),
    deepspeed: DeepSpeedOptions | None = None,
    horovod: HorovodOptions | None = None,
) -> Backend:
    """The backend `name` ('auto' resolves from the launcher), not yet set up; each takes its own options."""
    name = resolve_backend(name, topo)
    if name == "single":
        from .single import SingleBackend

        return SingleBackend(topo, opts)
    if name == "ddp":
        from .torch_ddp import DDPBackend

        return DDPBackend(topo, opts)
    if name == "fsdp":
        from .torch_fsdp import FSDPBackend

        return FSDPBackend(topo, opts)
    if name == "deepspeed":
        try:
            from .deepspeed_backend import DeepSpeedBackend
        except ImportError as e:
            raise ImportError(f"--distributed_backend deepspeed needs deepspeed ({e}): run `make install`") from None
        return DeepSpeedBackend(topo, opts, deepspeed)
    if name == "horovod":
        try:
            from .horovod_backend import HorovodBackend
        except ImportError as e:
            raise ImportError(f"--distributed_backend horovod needs horovod ({e}): run `make install`") from None
        return HorovodBackend(topo, opts, horovod)
    raise ValueError(f"unknown --distributed_backend {name}")


def read_weights(ckpt_dir: str) -> dict:
    """Full model weights (CPU, fp32) from a resume checkpoint directory of any backend, without a process
    group: the DCP copy every backend writes, or DeepSpeed's own ZeRO shards."""
    from .checkpoint_io import read_dcp_weights

    weights = read_dcp_weights(ckpt_dir)
    if weights is None:
        try:
            from .deepspeed_backend import read_weights as read_zero_weights
        except ImportError:
            read_zero_weights = lambda _: None  # noqa: E731
        weights = read_zero_weights(ckpt_dir)
    if weights is None:
        raise FileNotFoundError(f"{ckpt_dir} holds no checkpoint: expected a dcp/ folder (or DeepSpeed's) inside")
    return weights


__all__ = [
    "BACKENDS",
    "BACKEND_OPTIONS",
    "Backend",
    "DeepSpeedOptions",
    "HorovodOptions",
    "Recovery",
    "StepOptions",
    "StepResult",
    "Topology",
    "Workload",
    "applicable_options",
    "make_backend",
    "read_weights",
    "resolve_backend",
    "set_threads",
    "topology_from_env",
]
