"""The loop's metrics between two log steps, reduced over the ranks in one collective with each rank's
peak memory, then written to the run (metrics.jsonl, TensorBoard, wandb, the console)."""

from __future__ import annotations

import time

import torch


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class MetricWindow:
    def __init__(self, backend, task, run, cfg, total: int):
        self.backend, self.task, self.run, self.cfg = backend, task, run, cfg
        self.total = total
        self._reset()

    def _reset(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.count, self.t0 = 0, time.perf_counter()  # micro-batches on this rank
        self.wait = 0.0  # seconds this rank waited for its batches

    def waited(self, seconds: float) -> None:
        """Time spent in next(data): when it is a large share of the step, more --num_workers would help."""
        self.wait += seconds

    def add(self, loss: torch.Tensor, metrics: dict) -> None:
        """One micro-batch's loss and metrics, kept on the device (no host sync)."""
        for k, v in {"loss": loss.detach(), **metrics}.items():
            self.sums[k] = self.sums.get(k, 0) + v.float()
        self.count += 1

    def flush(self, pos, result, lr: float, bar) -> dict:
        """Log the window; returns the row. Every rank calls it."""
        b = self.backend
        names = sorted(self.sums)
        # one collective for the step: metric means, every rank's peak memory in its own slot, the share of time
        # waiting for data (mean over ranks), a stream's skipped samples by reason (summed)
        elapsed = time.perf_counter() - self.t0
        memory = torch.zeros(b.world_size)
        memory[b.rank] = peak_memory_mb(b.device)
        skips = self.task.dataset.data_counts() if hasattr(self.task.dataset, "data_counts") else {}
        means = torch.stack([self.sums[k] / self.count for k in names]) / b.world_size
        extra = torch.tensor([self.wait / elapsed / b.world_size, *skips.values()], dtype=torch.float64)
        local = torch.cat([means, memory.to(b.device), extra.to(means.dtype).to(b.device)])
        reduced = b.all_reduce(local, op="sum").tolist()  # the host sync of the step, only when logging
        n = len(names)
        means, memory = reduced[:n], reduced[n : n + b.world_size]
        wait_share, skipped = reduced[n + b.world_size], reduced[n + b.world_size + 1 :]
        images_per_s = self.count * self.cfg.batch_size * b.world_size / elapsed
        row = dict(zip(names, means))
        row.update(
            seconds_per_step=elapsed * self.cfg.accumulation_steps(b.world_size) / self.count,
            lr=lr,
            grad_norm=float(result.grad_norm),
            skipped=bool(result.skipped),
            loss_scale=result.loss_scale,
            epoch=pos.epoch,
            images_per_s=images_per_s,
            **self.task.window_metrics(),
            memory_mb_per_rank=[round(m) for m in memory],
            images_per_s_per_rank=images_per_s / b.world_size,
            tokens_per_s=images_per_s * self.task.tokens_per_sample,
            data_wait_share=wait_share,
            **{name: round(v) for name, v in zip(skips, skipped)},
        )
        self.run.log_metrics(pos.step, row)
        if bar is not None:
            bar.set_postfix(loss=f"{row['loss']:.4f}", img_s=f"{row['images_per_s']:.0f}")
        elif not self.cfg.quiet:
            self.run.print(f"step {pos.step}/{self.total} " + " ".join(f"{k} {_fmt(v)}" for k, v in row.items()))
        self._reset()
        return row


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
