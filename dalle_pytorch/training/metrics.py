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

    def add(self, loss: torch.Tensor, metrics: dict) -> None:
        """One micro-batch's loss and metrics, kept on the device (no host sync)."""
        for k, v in {"loss": loss.detach(), **metrics}.items():
            self.sums[k] = self.sums.get(k, 0) + v.float()
        self.count += 1

    def flush(self, pos, result, lr: float, bar) -> dict:
        """Log the window; returns the row. Every rank calls it."""
        b = self.backend
        names = sorted(self.sums)
        # one collective for the step: metric means, every rank's peak memory in its own slot
        memory = torch.zeros(b.world_size)
        memory[b.rank] = peak_memory_mb(b.device)
        means = torch.stack([self.sums[k] / self.count for k in names]) / b.world_size
        local = torch.cat([means, memory.to(b.device)])
        reduced = b.all_reduce(local, op="sum").tolist()  # the host sync of the step, only when logging
        means, memory = reduced[: len(names)], reduced[len(names) :]
        elapsed = time.perf_counter() - self.t0
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
