"""The Ray Train launcher's flags. Pure: read by arguments.py without importing ray."""

from __future__ import annotations

from dataclasses import dataclass

from dalle_pytorch.config import flag


@dataclass
class RayOptions:
    ray_workers: str = flag(
        "",
        "run the training on N Ray Train workers (python train_dalle.py --ray_workers N, no other launcher), or on "
        "MIN:MAX of them: an elastic run that goes on with fewer after a node is lost and grows again when it "
        "comes back (needs --global_batch_size)",
    )
    ray_address: str = flag(
        "auto", "the Ray cluster to run on: HOST:PORT of its head, 'auto' (the one `ray start` started here) or "
        "'local' (start one in this process, on this machine)",
    )  # fmt: skip
    ray_max_failures: int = flag(
        0, "restarts of the Ray workers after a failure (a lost node, a crashed worker), each from the run's last "
        "checkpoint; -1: without limit",
    )  # fmt: skip
    ray_resize_every: float = flag(
        60.0, "--ray_workers MIN:MAX: seconds between Ray's looks for room to grow (a node back or added); growing "
        "restarts the workers from the newest checkpoint",
    )  # fmt: skip
    ray_cpus_per_worker: float = flag(1.0, "CPUs Ray reserves for each worker")
    ray_wait: float = flag(
        60.0,
        "seconds to wait for the Ray cluster to have room for the workers before stopping with what is "
        "missing; after a failure, how long each restart waits for its workers before trying again with fewer",
    )

    def worker_range(self) -> tuple[int, int]:
        """(min, max) workers: (N, N) for a fixed count."""
        lo, sep, hi = self.ray_workers.partition(":")
        try:
            lo_n, hi_n = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"--ray_workers takes N or MIN:MAX (got {self.ray_workers!r})") from None
        if not 1 <= lo_n <= hi_n:
            raise ValueError(f"--ray_workers needs 1 <= MIN <= MAX (got {self.ray_workers!r})")
        return lo_n, hi_n

    def validate(self) -> None:
        self.worker_range()
        if self.ray_max_failures < -1:
            raise ValueError(f"--ray_max_failures must be >= 0, or -1 for no limit (got {self.ray_max_failures})")
        if not self.ray_cpus_per_worker > 0:
            raise ValueError(f"--ray_cpus_per_worker must be positive (got {self.ray_cpus_per_worker:g})")
        if not self.ray_resize_every > 0:
            raise ValueError(f"--ray_resize_every must be a positive number of seconds (got {self.ray_resize_every:g})")
        if not self.ray_wait > 0:
            raise ValueError(f"--ray_wait must be a positive number of seconds (got {self.ray_wait:g})")
