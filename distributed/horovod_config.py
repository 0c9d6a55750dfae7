"""The Horovod backend's flags. Pure: read by arguments.py without importing horovod."""

from __future__ import annotations

from dataclasses import dataclass

from dalle_pytorch.config import flag


@dataclass
class HorovodOptions:
    horovod_compression: str = flag("none", "Horovod gradient compression for the allreduce", choices=("none", "fp16"))
    commit_every: int = flag(
        10, "Horovod elastic: steps between in-memory state commits; a lost worker costs at most this many steps"
    )

    def validate(self) -> None:
        if self.commit_every < 1:
            raise ValueError(f"--commit_every must be at least 1 (got {self.commit_every})")
