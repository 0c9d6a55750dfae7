"""Resume checkpoints: directories the backend writes (sharded where it shards), one per saved step.

A resume checkpoint is written to `step-XXXXXXXX.tmp/` and renamed once every rank has finished, so a
crash mid-write leaves the previous one intact and `--resume auto` never picks a partial one.
"""

from __future__ import annotations

import os
import re
import shutil

_STEP_DIR = re.compile(r"^step-(\d{8})$")
COMPLETE = "COMPLETE"


# ------------------------------------------------------------------------------------ resume checkpoints


def step_dirs(root: str) -> list[str]:
    """Complete checkpoint directories under `root`, newest first."""
    if not os.path.isdir(root):
        return []
    found = [d for d in os.listdir(root) if _STEP_DIR.match(d) and os.path.exists(os.path.join(root, d, COMPLETE))]
    return [os.path.join(root, d) for d in sorted(found, reverse=True)]


def save_checkpoint(backend, root: str, step: int, state: dict, keep: int, extra: dict | None = None) -> str:
    """Collective: write a resume checkpoint for `step` atomically, then prune to the newest `keep`; `extra`:
    tensors beside the weights (the EMA), as backend.save_checkpoint takes them."""
    final = os.path.join(root, f"step-{step:08d}")
    tmp = final + ".tmp"
    if backend.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    backend.barrier()
    backend.save_checkpoint(tmp, state, extra)
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
