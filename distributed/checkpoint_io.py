"""File helpers shared by the backends' checkpoint methods: the states file and per-rank RNG files.

Everything is loaded with `weights_only=True`: a checkpoint that needs arbitrary unpickling is refused.
"""

from __future__ import annotations

import os
import random
import warnings

import numpy as np
import torch

from dalle_pytorch.files import safe_load

STATES_FILE = "states.pt"
# One process writing or reading a whole DCP checkpoint alone (Horovod, one process, DeepSpeed's portable
# copy) is intended here; DCP warns about it on every call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def save_shared_file(directory: str, obj: dict) -> None:
    os.makedirs(directory, exist_ok=True)
    torch.save(obj, os.path.join(directory, STATES_FILE))


def load_shared_file(directory: str, map_location="cpu") -> dict:
    return safe_load(os.path.join(directory, STATES_FILE), map_location)


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_to_tuple(state["python"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_tuple(x):
    return tuple(_to_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def save_rank_file(directory: str, rank: int) -> None:
    os.makedirs(directory, exist_ok=True)
    torch.save(_plain(rng_state()), os.path.join(directory, f"rng-rank{rank}.pt"))


def load_rank_file(directory: str, rank: int) -> None:
    """This rank's RNG states, where the checkpoint has them (not at a larger world size than it was written at)."""
    path = os.path.join(directory, f"rng-rank{rank}.pt")
    if os.path.exists(path):
        set_rng_state(safe_load(path))


def _plain(x):
    """numpy RNG state holds an ndarray, which weights_only loading refuses; store it as a tensor."""
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x.copy())
    if isinstance(x, tuple):
        return tuple(_plain(v) for v in x)
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def load_extra(directory: str, extra: dict) -> list[str]:
    """Collective where a process group exists (each rank reads alone otherwise): load the sets of `extra` that
    the checkpoint's dcp/ folder holds into their tensors, in place; returns the names of those it held."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = os.path.join(directory, "dcp")
    if not os.path.isdir(path):
        return []
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    held = [name for name in extra if any(k.startswith(name + ".") for k in keys)]
    if held:
        dcp.load({name: extra[name] for name in held}, checkpoint_id=path, no_dist=not dist.is_initialized())
    return held


def read_dcp_weights(ckpt_dir: str) -> dict | None:
    """Full model weights (CPU, fp32) of the DCP copy every backend writes, without a process group, or None
    when the checkpoint has no dcp/ folder."""
    if not os.path.isdir(os.path.join(ckpt_dir, "dcp")):
        return None
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "full.pt")
        dcp_to_torch_save(os.path.join(ckpt_dir, "dcp"), path)
        return {k: v.float() for k, v in safe_load(path)["model"].items()}
