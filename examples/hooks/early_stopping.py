"""Early stopping: stop the run when the validation loss has not improved by MIN_DELTA for PATIENCE evaluations.

    python train_dalle.py --vae_path vae.safetensors --val_every 200 --val_fraction 0.02 \
        --hooks examples/hooks/early_stopping.py:EarlyStopping

Every rank runs it on the same numbers (validation results and logged rows are reduced over the ranks), so every
rank asks to stop at the same step; the loop then saves a checkpoint and the export on all of them. Settings come
from the environment, so the same file serves any run: EARLY_STOPPING_KEY (default val_loss: a validation result,
read every --val_every steps; or any column of the logged rows, such as loss, read every --log_every steps),
EARLY_STOPPING_PATIENCE (default 5), EARLY_STOPPING_MIN_DELTA (default 0.001).
"""

from __future__ import annotations

import os

from dalle_pytorch.training.hooks import Hooks


class EarlyStopping(Hooks):
    def __init__(self):
        self.key = os.environ.get("EARLY_STOPPING_KEY", "val_loss")
        self.patience = int(os.environ.get("EARLY_STOPPING_PATIENCE", "5"))
        self.min_delta = float(os.environ.get("EARLY_STOPPING_MIN_DELTA", "0.001"))
        self.best, self.since_best = float("inf"), 0

    def on_evaluation(self, ctx, step, results):
        if self.key.startswith("val_"):
            self._watch(ctx, results)

    def on_log(self, ctx, step, row):
        if not self.key.startswith("val_"):
            self._watch(ctx, row)

    def _watch(self, ctx, values: dict) -> None:
        if self.key not in values:
            raise ValueError(f"EARLY_STOPPING_KEY={self.key}: the values here are {', '.join(sorted(values))}")
        value = values[self.key]
        if value < self.best - self.min_delta:
            self.best, self.since_best = value, 0
            return
        self.since_best += 1
        if self.since_best >= self.patience:
            ctx.request_stop(
                f"early stopping: {self.key} {value:.4f} has not improved on {self.best:.4f} by {self.min_delta:g} "
                f"for {self.patience} checks"
            )

    def on_end(self, ctx, step):
        if not ctx.is_main:
            return
        if self.best == float("inf"):
            print(f"early stopping: never saw {self.key} (validation needs --val_every N)")
        else:
            print(f"early stopping: best {self.key} {self.best:.4f}, stopped at step {step} of {ctx.total_steps}")
