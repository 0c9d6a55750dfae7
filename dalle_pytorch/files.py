"""Reading and writing this project's files safely: weights-only loading with errors that say what to do,
atomic writes, and the one fingerprint of a model's config and weights. Depends on torch only, so the
backends, the trainers and generate.py all use it."""

from __future__ import annotations

import hashlib
import json
import os

import torch


def safe_load(path: str, map_location="cpu"):
    """torch.load with weights_only=True and errors that name the file and say what to do."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # UnpicklingError, RuntimeError or EOFError depending on the damage
        msg = str(e)
        if "weights_only" in msg or "Unsupported global" in msg or "Unsupported operand" in msg:
            raise ValueError(
                f"refusing to load {path}: it contains pickled code, not only tensors and plain data. "
                "Only load files written by this project."
            ) from None
        raise ValueError(
            f"{path} is truncated or corrupted ({type(e).__name__}: {msg[:160]}); use an earlier checkpoint"
        ) from None


def atomic_save(obj, path: str) -> None:
    """torch.save to a temporary name, fsync, then rename over `path`: readers see old or new, never half."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fingerprint(config: dict, weights: dict[str, torch.Tensor]) -> str:
    """A short hash of a model's config and weights: resuming or generating with another image tokenizer would
    silently change the meaning of every image token. The same for a .ckpt, .pkl or .pt holding one model."""
    h = hashlib.sha1(json.dumps(config, sort_keys=True).encode())
    for name in sorted(weights):
        h.update(name.encode())
        h.update(weights[name].detach().float().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
