"""The one training loop, shared by train_vae.py and train_dalle.py and by every backend.

"The model returns its losses, the loop owns optimisation" (detectron2's SimpleTrainer): a task supplies
the model, the data, `loss(model, batch, step)`, samples and the export; the backend supplies
communication, precision and checkpoint I/O. The loop names no backend.
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from .checkpoints import resolve_resume, save_checkpoint
from .run import RunDir, progress
from .schedules import lr_factor


class Task(Protocol):
    name: str
    model: nn.Module
    dataset: torch.utils.data.Dataset

    def prepare_batch(self, batch, device: torch.device): ...  # no grad, full precision (e.g. VAE tokens)
    def loss(self, model: nn.Module, batch, step: int) -> tuple[torch.Tensor, dict]: ...
    def window_metrics(self) -> dict: ...
    def write_samples(self, model: nn.Module, step: int, path: str | None) -> None: ...  # every rank; writes if path
    def export(self, weights: dict, path: str) -> None: ...  # rank 0 only


class ShardedSampler(torch.utils.data.Sampler):
    """Disjoint per-rank shards of a seeded per-epoch permutation, resumable at any position.

    Like DistributedSampler with drop_last, plus a start position so that a resumed run continues exactly
    where the interrupted one was instead of replaying the epoch. Rank r takes every world_size-th sample,
    so the samples all ranks have consumed are a prefix of the permutation: the position is one number,
    valid at any world size (a resume on more or fewer ranks, an elastic run losing a worker).
    """

    def __init__(self, length: int, rank: int, world_size: int, seed: int, batch_size: int):
        self.per_rank = self.shard_size(length, world_size, batch_size)
        if self.per_rank == 0:
            raise ValueError(
                f"{length} samples are not enough for one batch of {batch_size} on each of {world_size} ranks: "
                "lower --batch_size or add data"
            )
        self.length, self.rank, self.world_size, self.seed = length, rank, world_size, seed
        self.batch_size = batch_size
        self.epoch, self.consumed = 0, 0

    @staticmethod
    def shard_size(length: int, world_size: int, batch_size: int) -> int:
        """Samples per rank per epoch: an equal share, cut to whole batches."""
        return (length // world_size) // batch_size * batch_size

    def set_position(self, epoch: int, consumed: int) -> None:
        """`consumed`: samples of the epoch's permutation already trained on, by all ranks together."""
        self.epoch, self.consumed = epoch, consumed

    def __len__(self) -> int:
        left = max(self.per_rank * self.world_size - self.consumed, 0)
        return left // self.world_size // self.batch_size * self.batch_size

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(self.length, generator=g)[: self.per_rank * self.world_size]
        return iter(perm[self.consumed :][self.rank :: self.world_size][: len(self)].tolist())


def total_steps(cfg, dataset_len: int | None, world_size: int) -> int:
    """Optimizer steps of the run: --steps, or --epochs over each rank's shard (a stream needs --steps)."""
    if cfg.steps:
        return cfg.steps
    per_rank = ShardedSampler.shard_size(dataset_len, world_size, cfg.batch_size)
    return cfg.epochs * max(per_rank // cfg.batch_size // cfg.accumulation_steps(world_size), 1)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no weight decay for biases, norms and embeddings (1-D params and nn.Embedding)."""
    no_decay = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, rest = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (rest if p.dim() < 2 or id(p) in no_decay else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


@dataclass
class Position:
    step: int = 0
    epoch: int = 0
    samples_in_epoch: int = 0  # samples of this epoch already consumed, by all ranks together

    @classmethod
    def from_state(cls, state: dict, samples_per_batch: int) -> Position:
        """The saved position; checkpoints written before positions counted samples held per-rank
        micro-batches, converted here at the current batch size and world size (exact when unchanged)."""
        state = dict(state)
        if "batch_in_epoch" in state:
            state["samples_in_epoch"] = state.pop("batch_in_epoch") * samples_per_batch
        return cls(**state)


def train(task: Task, cfg, backend, run: RunDir) -> Position:
    """Train `task` with `backend` as `cfg` says; returns where training stopped."""
    # per-rank batch and accumulation stay fixed for the run; an elastic run that loses or gains
    # workers changes the global batch with them (and says so), it rescales nothing silently
    accum = cfg.accumulation_steps(backend.world_size)
    streamed = isinstance(task.dataset, torch.utils.data.IterableDataset)  # shards split per rank by the dataset
    if streamed and not cfg.steps:
        raise ValueError("streamed WebDataset shards have no known length: set --steps")
    if streamed and backend.world_size_may_change:
        raise ValueError(
            "streamed WebDataset shards are split among the ranks when the run starts, so an elastic run cannot "
            "stream them: use a caption folder (or export the shards to one) or a fixed number of workers"
        )
    total = total_steps(cfg, None if streamed else len(task.dataset), backend.world_size)

    def make_optimizer(model):  # built by the backend after wrapping: sharding replaces the parameters
        return torch.optim.AdamW(
            param_groups(model, cfg.weight_decay), lr=cfg.learning_rate, betas=(0.9, 0.99), foreach=True
        )

    def make_scheduler(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(s, total, cfg.warmup_steps, cfg.lr_decay, cfg.lr_min_factor)
        )

    if cfg.compile:
        task.model.compile()  # in place: same module, same state_dict keys, under any backend's wrapper
    activation_bytes = task.activation_bytes(cfg.batch_size) if hasattr(task, "activation_bytes") else 0.0
    model, optimizer, scheduler = backend.prepare(task.model, make_optimizer, make_scheduler, activation_bytes)

    pos = Position()
    for candidate in resolve_resume(cfg.resume, run.checkpoints):
        try:
            pos = Position.from_state(backend.load_checkpoint(candidate), cfg.batch_size * backend.world_size)
            run.print(f"resumed from {candidate} at step {pos.step}")
            break
        except (ValueError, FileNotFoundError, KeyError, TypeError) as e:  # damaged: fall back to an older one
            run.print(f"skipping checkpoint {candidate}: {e}")
    else:
        if cfg.resume and cfg.resume != "auto":
            raise ValueError(f"--resume {cfg.resume}: the checkpoint could not be loaded (see above)")

    # SIGTERM (a preempted node): finish the current step, save, exit.
    stop = {"now": False}
    old_handler = signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))

    def run_from(pos: Position) -> Position:
        """The steps from `pos` to the end. What depends on the rank and world size is built here, so an
        elastic backend can call it again, on the position it rolled back to, after workers came or went."""
        if backend.is_main:  # rank 0 may have been lost and replaced by this worker
            run.become_main()
        sampler, loader = _loader(task, cfg, backend, streamed)
        global_batch = cfg.batch_size * backend.world_size * accum
        run.print(
            f"{task.name}: {total} steps, global batch {global_batch} = {cfg.batch_size} per rank x "
            f"{backend.world_size} ranks x {accum} accumulation, backend {backend.name}, precision {cfg.precision}"
        )

        def batches():
            while True:
                skip = 0
                if sampler is not None:  # resumes exactly at the next unseen sample
                    sampler.set_position(pos.epoch, pos.samples_in_epoch)
                else:  # a stream is replayed to the resume position (same shard order and shuffle seeds)
                    task.dataset.set_epoch(pos.epoch)
                    skip = pos.samples_in_epoch // (cfg.batch_size * backend.world_size)
                for i, batch in enumerate(loader):
                    if i < skip:
                        continue
                    pos.samples_in_epoch += cfg.batch_size * backend.world_size
                    yield batch
                if pos.samples_in_epoch == 0:
                    raise ValueError("the data yielded no batch: check the dataset and --batch_size")
                pos.epoch, pos.samples_in_epoch = pos.epoch + 1, 0

        data = batches()
        bar = progress(total, pos.step, not cfg.quiet and backend.is_main)
        sums: dict[str, torch.Tensor] = {}
        count, t0, samples_seen = 0, time.perf_counter(), 0
        model.train()
        if pos.step == 0 and cfg.save_every_n_steps:  # a checkpoint before training starts catches setup bugs early
            save_checkpoint(backend, run.checkpoints, 0, vars(pos), cfg.keep_n_checkpoints)
        while pos.step < total:
            for micro in range(accum):
                batch = task.prepare_batch(next(data), backend.device)
                with backend.accumulate(model, sync=micro == accum - 1):
                    with backend.autocast():
                        loss, metrics = task.loss(model, batch, pos.step)
                    backend.backward(loss)
                for k, v in {"loss": loss.detach(), **metrics}.items():
                    sums[k] = sums.get(k, 0) + v.float()
                count += 1
            grad_norm, skipped = backend.step()
            pos.step += 1
            samples_seen += global_batch
            if bar is not None:
                bar.update(1)

            if pos.step % cfg.log_every == 0 or pos.step == total:
                names = sorted(sums)
                # one collective for all metrics; the only host sync of the step, and only when logging
                means = backend.all_reduce(torch.stack([sums[k] / count for k in names]).to(backend.device)).tolist()
                elapsed = time.perf_counter() - t0
                row = dict(zip(names, means))
                row.update(
                    lr=scheduler.get_last_lr()[0],
                    grad_norm=float(grad_norm),
                    skipped=bool(skipped),
                    loss_scale=backend.loss_scale(),
                    epoch=pos.epoch,
                    images_per_s=samples_seen / elapsed,
                    **task.window_metrics(),
                )
                # every rank's peak memory, one slot each, summed: the per-rank view for imbalance and OOM hunting
                memory = torch.zeros(backend.world_size, device=backend.device)
                memory[backend.rank] = peak_memory_mb(backend.device)
                row["memory_mb_per_rank"] = [round(m) for m in backend.all_reduce(memory, op="sum").tolist()]
                row["images_per_s_per_rank"] = row["images_per_s"] / backend.world_size
                row["tokens_per_s"] = row["images_per_s"] * getattr(task, "tokens_per_sample", 0)
                run.log_metrics(pos.step, row)
                if bar is not None:
                    bar.set_postfix(loss=f"{row['loss']:.4f}", img_s=f"{row['images_per_s']:.0f}")
                elif not cfg.quiet:
                    run.print(f"step {pos.step}/{total} " + " ".join(f"{k} {_fmt(v)}" for k, v in row.items()))
                if not math.isfinite(row["loss"]) and cfg.precision != "fp16":
                    raise FloatingPointError(
                        f"loss is {row['loss']} at step {pos.step}: lower --learning_rate or use --clip_grad_norm"
                    )
                sums, count, t0, samples_seen = {}, 0, time.perf_counter(), 0

            if cfg.sample_every and pos.step % cfg.sample_every == 0:
                _samples(task, model, backend, pos.step, os.path.join(run.samples, f"step-{pos.step:08d}.png"))
            stopping = False
            if pos.step % cfg.log_every == 0:  # checked with the logging sync, not every step
                flag = torch.tensor(float(stop["now"]), device=backend.device)
                stopping = bool(backend.all_reduce(flag, op="sum") > 0)
            at_save = cfg.save_every_n_steps and pos.step % cfg.save_every_n_steps == 0
            if at_save or stopping or pos.step == total:
                save_checkpoint(backend, run.checkpoints, pos.step, vars(pos), cfg.keep_n_checkpoints)
                _export(task, model, backend)
            if stopping:
                run.print(f"SIGTERM: saved a checkpoint at step {pos.step}; resume with --resume auto")
                break
            backend.commit(pos)  # elastic backends: an in-memory copy to roll back to when a worker is lost
        if bar is not None:
            bar.close()
        return pos

    pos = backend.run(run_from, pos)
    signal.signal(signal.SIGTERM, old_handler)
    _samples(task, model, backend, pos.step, os.path.join(run.samples, "final.png"))
    return pos


def _loader(task: Task, cfg, backend, streamed: bool):
    sampler = (
        None
        if streamed
        else ShardedSampler(len(task.dataset), backend.rank, backend.world_size, cfg.seed, cfg.batch_size)
    )
    loader = torch.utils.data.DataLoader(
        task.dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        num_workers=cfg.num_workers,
        pin_memory=backend.device.type == "cuda",
        drop_last=True,
        persistent_workers=False,
        # its own generator: creating an iterator must not consume the global RNG, or a resumed run's
        # random stream (Gumbel noise, dropout) would drift from the uninterrupted one
        generator=torch.Generator().manual_seed(cfg.seed + backend.rank),
        multiprocessing_context="fork" if cfg.num_workers > 0 else None,
    )
    return sampler, loader


def _samples(task: Task, model, backend, step: int, path: str) -> None:
    """Every rank generates (sharded parameters need every rank to gather); rank 0 writes."""
    with backend.full_params(model) as module:
        module.eval()
        task.write_samples(module, step, path if backend.is_main else None)
        module.train()


def _export(task: Task, model, backend) -> None:
    weights = backend.full_state_dict(model)  # collective: gathers shards on every rank
    if backend.is_main:
        task.export(weights, task.export_path)
    backend.barrier()


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
