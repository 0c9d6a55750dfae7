"""One Backend interface, one file per backend. `make_backend` picks and builds one lazily, so that
heavy optional packages (deepspeed, horovod) are imported only when asked for."""

from __future__ import annotations

from arguments import Topology, resolve_backend

from .base import Backend


def make_backend(name: str, topo: Topology, **kw) -> Backend:
    """The backend `name` ('auto' resolves from the launcher), not yet set up."""
    name = resolve_backend(name, topo)
    if name == "single":
        from .single import SingleBackend as cls
    elif name == "ddp":
        from .torch_ddp import DDPBackend as cls
    elif name == "fsdp":
        from .torch_fsdp import FSDPBackend as cls
    elif name == "deepspeed":
        try:
            from .deepspeed_backend import DeepSpeedBackend as cls
        except ImportError as e:
            raise ImportError(f"--distributed_backend deepspeed needs deepspeed ({e}): run `make install`") from None
    elif name == "horovod":
        try:
            from .horovod_backend import HorovodBackend as cls
        except ImportError as e:
            raise ImportError(f"--distributed_backend horovod needs horovod ({e}): run `make install`") from None
    else:
        raise ValueError(f"unknown --distributed_backend {name}")
    return cls(topo, **kw)


__all__ = ["Backend", "make_backend"]
