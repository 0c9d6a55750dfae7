"""The loop's metrics between two log steps, reduced over the ranks in one collective with each rank's own
figures (rank_stats.py), then written to the run (metrics.jsonl, TensorBoard, wandb, MLflow, the console)."""

from __future__ import annotations

import torch

from .rank_stats import RankClock, RankSummary, Stragglers, figure_names, hostnames, peak_memory_mb


class MetricWindow:
    def __init__(self, backend, task, run, plan):
        cfg = plan.cfg
        self.backend, self.task, self.run, self.cfg = backend, task, run, cfg
        self.total, self.accum = plan.steps, plan.accumulation
        self.clock = RankClock(backend.device)
        self.figures = figure_names(backend.device)
        hosts = hostnames(backend)  # a collective, once: every rank builds its window at the same point
        self.stragglers = Stragglers(hosts, cfg.straggler_margin, cfg.straggler_patience, run.print)
        self.summary = RankSummary(hosts)
        self._reset()

    def _reset(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.count = 0  # micro-batches on this rank
        self.clock.reset()

    def add(self, loss: torch.Tensor, metrics: dict) -> None:
        """One micro-batch's loss and metrics, kept on the device (no host sync)."""
        for k, v in {"loss": loss.detach(), **metrics}.items():
            self.sums[k] = self.sums.get(k, 0) + v.float()
        self.count += 1

    def flush(self, pos, result, lr: float, bar) -> dict:
        """Log the window; returns the row. Every rank calls it."""
        b = self.backend
        names = sorted(self.sums)
        accum = self.accum
        # one collective for the step: metric means, every rank's figures in its own row, a stream's skipped
        # samples by reason (summed)
        elapsed, mine = self.clock.figures(max(1, self.count // accum))
        per_rank = torch.zeros(b.world_size, len(self.figures), dtype=torch.float64)
        per_rank[b.rank] = torch.tensor([mine[f] for f in self.figures], dtype=torch.float64)
        skips = self.task.dataset.data_counts() if hasattr(self.task.dataset, "data_counts") else {}
        means = torch.stack([self.sums[k] / self.count for k in names]) / b.world_size
        extra = torch.cat([per_rank.flatten(), torch.tensor(list(skips.values()), dtype=torch.float64)])
        local = torch.cat([means.double(), extra.to(b.device)])  # float64: byte counts and ms stay exact
        reduced = b.all_reduce(local, op="sum").tolist()  # the host sync of the step, only when logging
        n, k = len(names), len(self.figures)
        means, skipped = reduced[:n], reduced[n + b.world_size * k :]
        rows = [dict(zip(self.figures, reduced[n + r * k : n + (r + 1) * k])) for r in range(b.world_size)]
        images_per_s = self.count * self.cfg.batch_size * b.world_size / elapsed
        row = dict(zip(names, means))
        row.update(
            seconds_per_step=elapsed * accum / self.count,
            lr=lr,
            grad_norm=float(result.grad_norm),
            skipped=bool(result.skipped),
            loss_scale=result.loss_scale,
            epoch=pos.epoch,
            images_per_s=images_per_s,
            **self.task.window_metrics(),
            images_per_s_per_rank=images_per_s / b.world_size,
            tokens_per_s=images_per_s * self.task.tokens_per_sample,
            data_wait_share=sum(r["data_wait_share"] for r in rows) / b.world_size,
            **{name: round(v) for name, v in zip(skips, skipped)},
            **{f"rank{r}/{f}": v for r, figures in enumerate(rows) for f, v in figures.items()},
        )
        self.run.log_metrics(pos.step, row)
        self.stragglers.see(pos.step, rows)
        self.summary.add(rows)
        if bar is not None:
            bar.set_postfix(loss=f"{row['loss']:.4f}", img_s=f"{row['images_per_s']:.0f}")
        elif not self.cfg.quiet:  # the per-rank figures go to the files, not the console
            shown = {k: v for k, v in row.items() if "/" not in k}
            self.run.print(f"step {pos.step}/{self.total} " + " ".join(f"{k} {_fmt(v)}" for k, v in shown.items()))
        self._reset()
        return row


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


__all__ = ["MetricWindow", "peak_memory_mb"]
