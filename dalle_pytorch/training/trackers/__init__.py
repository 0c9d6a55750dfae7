"""Where a run's metrics, sample grids, export and config go besides its directory: one small class per tracker
(as detectron2's EventWriter and torchtitan's logger), one failure guard for all, the same tracked run continued
after --resume or an elastic restart wherever the tracker can.

Adding a tracker: a file here with a class that has Tracker's methods and a `from_config(cfg, run_path,
continue_run, say)` that returns None when the run does not ask for it, and one line in REGISTRY (with its flags
in TrainConfig)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Protocol

REGISTRY = {  # name: "module:class" in this package, imported only when the run asks for it
    "tensorboard": "tensorboard_writer:TensorBoard",
    "wandb": "wandb_run:WandB",
    "mlflow": "mlflow_run:MLflowRun",
}


class Tracker(Protocol):
    label: str  # how the warnings name it ("MLflow at http://host:5000")

    def set_config(self, config: dict) -> None: ...
    def log_metrics(self, step: int, row: dict) -> None: ...
    def log_image(self, step: int, key: str, path: str) -> None: ...
    def log_artifact(self, path: str) -> None: ...
    def close(self, status: str) -> None: ...  # FINISHED, FAILED, or KILLED (SIGTERM: saved, to be resumed)


def read_run_id(path: str) -> str | None:
    """The tracked run's id a run directory keeps (mlflow_run_id, wandb_run_id), or None before its first start."""
    try:
        with open(path) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def open_trackers(cfg, run_path: str, continue_run: bool, say: Callable[[str], None]) -> list[Guarded]:
    """The trackers `cfg` asks for, started (a tracker that cannot start raises its one-line error)."""
    out = []
    for where in REGISTRY.values():
        module, cls = where.split(":")
        tracker = getattr(importlib.import_module(f".{module}", __name__), cls).from_config(
            cfg, run_path, continue_run, say
        )
        if tracker is not None:
            out.append(Guarded(tracker, say))
    return out


class Guarded:
    """A tracker whose first failure is said once and turns it off: the tracker is not worth the run (rank 0
    waiting on a tracker's retries would stall every rank), and the run directory has everything."""

    def __init__(self, tracker: Tracker, say: Callable[[str], None]):
        self.tracker, self._say, self.broken = tracker, say, False

    def set_config(self, config: dict) -> None:
        self._guard("the config", lambda: self.tracker.set_config(config))

    def log_metrics(self, step: int, row: dict) -> None:
        self._guard(f"the metrics of step {step}", lambda: self.tracker.log_metrics(step, row))

    def log_image(self, step: int, key: str, path: str) -> None:
        self._guard(f"uploading {path}", lambda: self.tracker.log_image(step, key, path))

    def log_artifact(self, path: str) -> None:
        self._guard(f"uploading {path}", lambda: self.tracker.log_artifact(path))

    def close(self, status: str) -> None:
        self._guard("the run's end", lambda: self.tracker.close(status))

    def _guard(self, what: str, call) -> None:
        if self.broken:
            return
        try:
            call()
        except Exception as e:  # noqa: BLE001 - the tracker is not worth the run: it goes on, its files have all
            self.broken = True
            name = self.tracker.label.split(" ")[0]
            first = (str(e).strip().splitlines() or [""])[0][:200]
            self._say(
                f"warning: {self.tracker.label} failed on {what} ({type(e).__name__}: {first}); the run goes on "
                f"without {name} (metrics.jsonl, samples/ and the export are in the run directory)"
            )
