"""--wandb: a Weights & Biases run (offline unless WANDB_MODE says otherwise: no account or network needed,
`wandb sync RUN/wandb/offline-run-*` later). Its id is kept in the run directory (wandb_run_id), so --resume, or
a worker that an elastic run made rank 0, goes on in the same wandb run."""

from __future__ import annotations

import os
import secrets

from . import read_run_id

RUN_ID_FILE = "wandb_run_id"


class WandB:
    label = "wandb"

    def __init__(self, run_path: str, project: str, entity: str | None, continue_run: bool):
        try:
            import wandb
        except ImportError:
            raise ImportError("--wandb needs the wandb package: pip install wandb (or drop --wandb)") from None
        os.environ.setdefault("WANDB_MODE", "offline")
        id_file = os.path.join(run_path, RUN_ID_FILE)
        previous = read_run_id(id_file) if continue_run else None
        self._wandb, self._name = wandb, os.path.basename(run_path)
        self._run = wandb.init(
            project=project, entity=entity, name=os.path.basename(run_path), dir=run_path,
            id=previous or secrets.token_hex(4), resume="allow",
        )  # fmt: skip
        with open(id_file, "w") as f:
            f.write(self._run.id)

    @classmethod
    def from_config(cls, cfg, run_path: str, continue_run: bool, say):
        if not cfg.wandb:
            return None
        return cls(run_path, cfg.wandb_project, cfg.wandb_entity or None, continue_run)

    def set_config(self, config: dict) -> None:
        self._run.config.update(config, allow_val_change=True)

    def log_metrics(self, step: int, row: dict) -> None:
        self._run.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=step)

    def log_image(self, step: int, key: str, path: str) -> None:
        self._run.log({key: self._wandb.Image(path)}, step=step)

    def log_artifact(self, path: str) -> None:
        """The export, as a model artifact named after the run."""
        artifact = self._wandb.Artifact(f"{self._name}-export", type="model")
        artifact.add_file(path)
        self._run.log_artifact(artifact)

    def close(self, status: str) -> None:
        self._run.finish(exit_code=0 if status != "FAILED" else 1)
