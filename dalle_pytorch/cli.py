"""What both training scripts share: topology -> backend -> run directory, and user errors as one line."""

from __future__ import annotations

import dataclasses
import os
import sys
from contextlib import contextmanager

import torch

from arguments import TrainConfig, topology_from_env
from distributed import make_backend

from .run import RunDir

USER_ERRORS = (ValueError, FileNotFoundError, ImportError, FloatingPointError, NotADirectoryError, PermissionError)


@contextmanager
def user_errors(debug: bool):
    """Errors a user can cause end in one line saying what to do; --debug shows the traceback."""
    try:
        yield
    except USER_ERRORS as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as e:
        if debug or e.errno != 28:
            raise
        print(f"error: out of disk space ({e}); free space or point --output_dir elsewhere", file=sys.stderr)
        raise SystemExit(2) from None


@contextmanager
def distributed_run(cfg: TrainConfig, default_name: str, configs: dict):
    """Set up the backend and the run directory; tear down on exit. Yields (backend, run)."""
    cfg.validate()
    topo = topology_from_env()
    backend = make_backend(
        cfg.distributed_backend,
        topo,
        precision=cfg.precision,
        accumulation_steps=cfg.accumulation_steps(topo.world_size),
        clip_grad_norm=cfg.clip_grad_norm,
        options=cfg,
    )
    backend.setup()
    backend.set_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    run = RunDir(
        os.path.join(cfg.output_dir, cfg.name or default_name),
        backend.is_main,
        cfg.tensorboard,
        cfg.wandb_project if cfg.wandb else None,
    )
    try:
        resolved = {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in configs.items()}
        accum = backend.accumulation_steps
        resolved["derived"] = {
            "backend": backend.name,
            "launcher": topo.launcher,
            "world_size": backend.world_size,
            "accumulation_steps": accum,
            "global_batch_size": cfg.batch_size * backend.world_size * accum,
        }
        run.write_config(resolved)
        yield backend, run
        # on success, no rank leaves the group while a peer may still be in a collective: a peer whose
        # connection closes mid-collective aborts (seen as a rare exit -6 under deepspeed ZeRO-3)
        backend.barrier()
    finally:
        run.close()
        backend.teardown()
