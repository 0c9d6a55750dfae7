"""Early stopping: stop the run when the logged loss has not improved by --min_delta for PATIENCE logs.

    python train_dalle.py --vae_path vae.safetensors --hooks examples/hooks/early_stopping.py:EarlyStopping

Every rank runs it on the same numbers (the metrics row is reduced over the ranks), so every rank asks to stop
at the same log step; the loop then saves a checkpoint and the export on all of them. Settings come from the
environment, so the same file serves any run: EARLY_STOPPING_PATIENCE (default 5 logs), EARLY_STOPPING_MIN_DELTA
(default 0.001), EARLY_STOPPING_KEY (default loss; any column of metrics.jsonl).
"""

from __future__ import annotations

import os

from dalle_pytorch.training.hooks import Hooks


class EarlyStopping(Hooks):
    def __init__(self):
        self.patience = int(os.environ.get("EARLY_STOPPING_PATIENCE", "5"))
        self.min_delta = float(os.environ.get("EARLY_STOPPING_MIN_DELTA", "0.001"))
        self.key = os.environ.get("EARLY_STOPPING_KEY", "loss")
        self.best, self.since_best = float("inf"), 0

    def on_log(self, ctx, step, row):
        if self.key not in row:
            raise ValueError(f"EARLY_STOPPING_KEY={self.key}: the logged metrics are {', '.join(sorted(row))}")
        value = row[self.key]
        if value < self.best - self.min_delta:
            self.best, self.since_best = value, 0
            return
        self.since_best += 1
        if self.since_best >= self.patience:
            ctx.request_stop(
                f"early stopping: {self.key} {value:.4f} has not improved on {self.best:.4f} by {self.min_delta:g} "
                f"for {self.patience} logs"
            )

    def on_end(self, ctx, step):
        if ctx.is_main:
            print(f"early stopping: best {self.key} {self.best:.4f}, stopped at step {step} of {ctx.total_steps}")
