"""Build the DeepSpeed ops this project uses now, at install time, instead of at a user's first run.

A build killed midway leaves a `lock` file in the torch extensions directory that makes every later
build wait forever; a lock with no compiler running is stale, and is removed first.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys


def remove_stale_locks(root: str) -> list[str]:
    building = subprocess.run(["pgrep", "-f", "ninja|c\\+\\+ .*torch_extensions"], capture_output=True).returncode == 0
    removed = []
    # <root>/<op>/lock with TORCH_EXTENSIONS_DIR set, <root>/<python+cuda tag>/<op>/lock under torch's default root
    for lock in glob.glob(os.path.join(root, "*", "lock")) + glob.glob(os.path.join(root, "*", "*", "lock")):
        if not building:
            os.remove(lock)
            removed.append(lock)
    return removed


def main() -> int:
    # the environment's own folder, as distributed/deepspeed_backend.py sets it (two .venvs would fight otherwise)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    from torch.utils.cpp_extension import (
        _get_build_directory,  # noqa: F401  (ensures torch is importable)
        get_default_build_root,
    )

    root = os.environ.get("TORCH_EXTENSIONS_DIR", get_default_build_root())
    for lock in remove_stale_locks(root):
        print(f"[install] removed a stale build lock: {lock}")
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        # the CPU accelerator's shared-memory allreduce, built on the first multi-rank run otherwise
        get_accelerator().create_op_builder("ShareMemCommBuilder").load(verbose=False)
        print("[install] DeepSpeed CPU ops built")
    return 0


if __name__ == "__main__":
    sys.exit(main())
