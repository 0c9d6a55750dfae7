"""Resume checkpoints (directories the backend writes) and exports (one self-describing file).

A resume checkpoint is written to `step-XXXXXXXX.tmp/` and renamed once every rank has finished, so a
crash mid-write leaves the previous one intact and `--resume auto` never picks a partial one. An export
is one file holding weights, the model config and a format version, loaded with `weights_only=True`.
"""

from __future__ import annotations

import os
import re
import shutil

import torch

EXPORT_FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{8})$")
COMPLETE = "COMPLETE"


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


# ------------------------------------------------------------------------------------------- exports


def save_export(path: str, kind: str, config: dict, weights: dict, **extra) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_save(
        {"format_version": EXPORT_FORMAT_VERSION, "kind": kind, "config": config, "weights": weights, **extra}, path
    )


def load_export(path: str, kind: str) -> dict:
    obj = safe_load(path)
    if not isinstance(obj, dict) or "format_version" not in obj or "kind" not in obj:
        raise ValueError(
            f"{path} is not an export of this project (no format_version): pass the vae.pt / dalle.pt that "
            "training wrote, or convert a resume checkpoint with `python -m dalle_pytorch.convert`"
        )
    if obj["kind"] != kind:
        raise ValueError(f"{path} is a {obj['kind']} export, expected a {kind} export")
    if obj["format_version"] > EXPORT_FORMAT_VERSION:
        raise ValueError(
            f"{path} has export format {obj['format_version']}; this code reads up to "
            f"{EXPORT_FORMAT_VERSION}: update the code"
        )
    return obj


# ------------------------------------------------------------------------------------ resume checkpoints


def step_dirs(root: str) -> list[str]:
    """Complete checkpoint directories under `root`, newest first."""
    if not os.path.isdir(root):
        return []
    found = [d for d in os.listdir(root) if _STEP_DIR.match(d) and os.path.exists(os.path.join(root, d, COMPLETE))]
    return [os.path.join(root, d) for d in sorted(found, reverse=True)]


def save_checkpoint(backend, root: str, step: int, state: dict, keep: int) -> str:
    """Collective: write a resume checkpoint for `step` atomically, then prune to the newest `keep`."""
    final = os.path.join(root, f"step-{step:08d}")
    tmp = final + ".tmp"
    if backend.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    backend.barrier()
    backend.save_checkpoint(tmp, state)
    backend.barrier()
    if backend.is_main:
        with open(os.path.join(tmp, COMPLETE), "w") as f:
            f.write(f"{step}\n")
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        for old in step_dirs(root)[max(keep, 1) :]:  # only after the new one is complete
            shutil.rmtree(old, ignore_errors=True)
    backend.barrier()
    return final


def resolve_resume(resume: str, root: str) -> list[str]:
    """Candidates to resume from, best first: the given directory, or for 'auto' every complete one."""
    if not resume:
        return []
    if resume == "auto":
        return step_dirs(root)
    if not os.path.isdir(resume):
        raise FileNotFoundError(f"--resume {resume}: no such checkpoint directory (or use --resume auto)")
    return [resume]
