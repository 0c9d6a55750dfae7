"""--tensorboard: TensorBoard event files in RUN/tensorboard (scalars only; TensorBoard continues a resumed run's
curves by step, as it reads every event file of the folder)."""

from __future__ import annotations

import math
import os


class TensorBoard:
    label = "TensorBoard"

    def __init__(self, run_path: str):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(os.path.join(run_path, "tensorboard"))

    @classmethod
    def from_config(cls, cfg, run_path: str, continue_run: bool, say):
        if not cfg.tensorboard:
            return None
        try:
            return cls(run_path)
        except ImportError:  # tensorboard is optional
            return None

    def set_config(self, config: dict) -> None:
        pass

    def log_metrics(self, step: int, row: dict) -> None:
        for k, v in row.items():
            if k not in ("step", "time") and isinstance(v, (int, float)) and math.isfinite(v):
                self._writer.add_scalar(k, v, step)

    def log_image(self, step: int, key: str, path: str) -> None:
        pass  # the grids are in RUN/samples/

    def log_artifact(self, path: str) -> None:
        pass

    def close(self, status: str) -> None:
        self._writer.close()
