"""The one training loop, shared by train_vae.py and train_dalle.py and by every backend.

"The model returns its losses, the loop owns optimisation" (detectron2's SimpleTrainer): a task supplies
the model, the data, `loss(model, batch, step)`, samples and the export (training/task.py); the backend
supplies communication, precision and checkpoint I/O; the recovery runs the loop again after an elastic
change of workers. The loop names no backend.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import torch

from distributed import Workload

from ..data.stream import is_stream
from .batches import ShardedSampler, Where, batches
from .checkpoints import resolve_resume, save_checkpoint
from .ema import EMA
from .fid_check import FidCheck
from .hooks import HookContext, HookList, load_hooks
from .metrics import MetricWindow
from .plan import RunPlan
from .run_dir import RunDir, progress
from .schedules import lr_factor
from .signals import GraceCheck, StopFlag, Stopped, StopVote
from .task import Task
from .validation import validate, whole_model


@dataclass
class Position:
    step: int = 0
    epoch: int = 0
    samples_in_epoch: int = 0  # samples of this epoch (of a stream: of its plan) consumed, by all ranks together
    stream: dict = field(default_factory=dict)  # a stream's plan for this epoch (shard_plan.replan's record)

    @property
    def data(self) -> Where:
        return Where(self.epoch, self.samples_in_epoch, self.stream)

    def moved_to(self, where: Where) -> None:
        """Where the data stands after the batch just read (the batch generator says; the loop keeps it)."""
        self.epoch, self.samples_in_epoch, self.stream = where.epoch, where.samples_in_epoch, where.stream


def train(task: Task, plan: RunPlan, backend, recovery, run: RunDir) -> Position:
    """Train `task` with `backend` as `plan` says (its flags, accumulation and steps, `RunPlan.counted` on the
    task's data); returns where training stopped."""
    cfg, total = plan.cfg, plan.steps
    assert total > 0, "the plan's steps are counted on the data (RunPlan.counted) before training"
    streamed = is_stream(task.dataset)
    if streamed and recovery.world_size_may_change:
        raise ValueError(
            "streamed WebDataset shards are split among the ranks when the run starts, so an elastic run cannot "
            "stream them: use a caption folder (or export the shards to one) or a fixed number of workers"
        )
    user_hooks = load_hooks(cfg.hooks)  # before anything trains: a hook that cannot load says so first
    if cfg.checkpoint_activations:
        enable_activation_checkpointing(task)
    if cfg.compile:
        task.model.compile()  # in place: same module, same state_dict keys, under any backend's wrapper
    model, _, scheduler = backend.prepare(
        task.model,
        lambda m: torch.optim.AdamW(
            param_groups(m, cfg.weight_decay), lr=cfg.learning_rate, betas=(0.9, 0.99), foreach=True
        ),
        lambda o: torch.optim.lr_scheduler.LambdaLR(
            o, lambda s: lr_factor(s, total, cfg.warmup_steps, cfg.lr_decay, cfg.lr_min_factor)
        ),
        Workload(micro_batch=cfg.batch_size, activation_bytes=task.activation_bytes(cfg.batch_size)),
    )
    ema = EMA(cfg.ema, backend.weights(model)) if cfg.ema else None
    fid = FidCheck(task, cfg, backend, run, run.print) if cfg.val_fid_every else None
    pos = resume(cfg.resume, backend, run, ema)
    if ema is not None:
        recovery.track(ema.average)
    with StopFlag() as stop:  # SIGTERM (a preempted node): finish the step (or the next), save, exit
        parts = Parts(task, plan, backend, recovery, run, model, scheduler, stop, user_hooks, ema, fid)
        pos = recovery.drive(lambda p: train_steps(parts, p), pos)
    write_samples(task, model, backend, os.path.join(run.samples, "final.png"), pos.step, run)
    if stop.reason == "SIGTERM" and pos.step < total:  # on every rank (the vote): saved, not finished
        raise Stopped(pos.step, getattr(task, "export_path", ""))
    return pos


@dataclass
class Parts:
    """What train() built and train_steps() uses."""

    task: Task
    plan: RunPlan
    backend: object
    recovery: object
    run: RunDir
    model: torch.nn.Module  # as the backend wrapped it
    scheduler: object
    stop: StopFlag
    hooks: list  # the user's (--hooks)
    ema: EMA | None  # --ema
    fid: FidCheck | None  # --val_fid_every

    @property
    def cfg(self):
        return self.plan.cfg

    @property
    def total(self) -> int:
        return self.plan.steps


def train_steps(parts: Parts, pos: Position) -> Position:
    """The steps from `pos` to the end. Everything that depends on the rank and world size is built here, so
    an elastic recovery can call it again, on the position it rolled back to, after workers came or went."""
    task, cfg, backend, run, model, total = parts.task, parts.cfg, parts.backend, parts.run, parts.model, parts.total
    if backend.is_main:
        run.become_main()  # an elastic run may have made this worker rank 0
    accum, global_batch = parts.plan.accumulation, parts.plan.global_batch(backend.world_size)
    run.print(
        f"{task.name}: {total} steps, global batch {global_batch} = {cfg.batch_size} per rank x "
        f"{backend.world_size} ranks x {accum} accumulation, backend {backend.name}, precision {cfg.precision}"
    )
    data = batches(task.dataset, cfg, backend, pos.data, run.print)
    window = MetricWindow(backend, task, run, parts.plan)
    vote = StopVote(parts.stop, backend)
    ctx = HookContext(task.name, backend.rank, backend.world_size, backend.is_main, run.path, total, task.model)
    hooks = HookList(parts.hooks, ctx, parts.stop)
    grace = GraceCheck(run.print, backend.is_main)
    bar = progress(total, pos.step, not cfg.quiet and backend.is_main)
    model.train()
    hooks.on_start(pos.step)
    if pos.step == 0 and cfg.save_every_n_steps:  # a checkpoint before training starts catches setup bugs early
        t0 = time.perf_counter()
        saved = save_checkpoint(backend, run.checkpoints, 0, vars(pos), cfg.keep_n_checkpoints, extra(parts))
        grace.saved(time.perf_counter() - t0)
        hooks.on_save(0, saved)
    clock = window.clock  # this rank's own time (data, hooks, the forward's compute): where a straggler shows
    with clock.watching(model, *backend.forward_watch(model)):  # (rank_stats.py), until these steps end
        while pos.step < total:
            with clock.own():
                hooks.before_step(pos.step)
            for micro in range(accum):
                with clock.waiting():
                    raw, where = next(data)
                pos.moved_to(where)
                with clock.own():
                    batch = task.prepare_batch(raw, backend.device)
                with backend.accumulate(model, sync=micro == accum - 1):
                    with backend.autocast(), clock.forward():
                        loss, metrics = task.loss(model, batch, pos.step)
                    backend.backward(loss)
                window.add(loss, metrics)
            result = backend.step()
            if parts.ema is not None:
                parts.ema.update(pos.step)
            pos.step += 1
            if bar is not None:
                bar.update(1)
            with clock.own():
                hooks.after_step(pos.step)
            logging = pos.step % cfg.log_every == 0 or pos.step == total
            if logging:
                log_window(parts, window, grace, hooks, pos, result, bar)
            if cfg.val_every and pos.step % cfg.val_every == 0 and getattr(task, "val_dataset", None) is not None:
                results = validate(task, model, backend, cfg, pos.step)
                run.log_metrics(pos.step, results)
                run.print(f"step {pos.step} validation " + " ".join(f"{k} {v:.4f}" for k, v in results.items()))
                hooks.on_evaluation(pos.step, results)
            if cfg.val_fid_every and pos.step % cfg.val_fid_every == 0:
                results = parts.fid(model, pos.step)
                run.log_metrics(pos.step, results)
                run.print(f"step {pos.step} " + " ".join(f"{k} {v:.4g}" for k, v in results.items()))
                hooks.on_evaluation(pos.step, results)
            # SIGTERM (or a hook's request, made above on a log or evaluation) on any rank, agreed on by all
            stopping = vote()
            if stopping and not logging:
                log_window(parts, window, grace, hooks, pos, result, bar)
            if cfg.sample_every and pos.step % cfg.sample_every == 0:
                write_samples(
                    task, model, backend, os.path.join(run.samples, f"step-{pos.step:08d}.png"), pos.step, run
                )
            if (cfg.save_every_n_steps and pos.step % cfg.save_every_n_steps == 0) or stopping or pos.step == total:
                t0 = time.perf_counter()
                saved = save_checkpoint(
                    backend, run.checkpoints, pos.step, vars(pos), cfg.keep_n_checkpoints, extra(parts)
                )
                grace.saved(time.perf_counter() - t0)
                hooks.on_save(pos.step, saved)
                export(task, model, backend, run, parts.ema)
            if stopping:
                run.print(f"{parts.stop.reason}: saved a checkpoint at step {pos.step}; resume with --resume auto")
                break
            parts.recovery.commit(pos)
    vote.close()
    for line in window.summary.lines():
        run.print(line, console=not cfg.quiet)  # --quiet: in train.log only
    hooks.on_end(pos.step)
    if bar is not None:
        bar.close()
    return pos


def log_window(parts: Parts, window: MetricWindow, grace, hooks, pos: Position, result, bar) -> None:
    """The metrics since the last log: written, shown to the hooks, and a non-finite loss stops the run."""
    row = window.flush(pos, result, parts.scheduler.get_last_lr()[0], bar)
    grace.stepped(row["seconds_per_step"])
    hooks.on_log(pos.step, row)
    if not math.isfinite(row["loss"]) and parts.cfg.precision != "fp16":
        raise FloatingPointError(
            f"loss is {row['loss']} at step {pos.step}: lower --learning_rate or use --clip_grad_norm"
        )


def enable_activation_checkpointing(task: Task) -> None:
    """--checkpoint_activations: every module of the model that can recompute its blocks in backward does."""
    found = [m for m in task.model.modules() if hasattr(m, "checkpoint_activations")]
    if not found:
        raise ValueError(f"--checkpoint_activations: the {task.name} model has no transformer blocks to recompute")
    for m in found:
        m.checkpoint_activations = True


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no weight decay for biases, norms and embeddings (1-D params and nn.Embedding)."""
    no_decay = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    decay, rest = [], []
    for p in model.parameters():
        if p.requires_grad:
            (rest if p.dim() < 2 or id(p) in no_decay else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def extra(parts: Parts) -> dict | None:
    """What checkpoints hold beside the training state: the EMA (collective)."""
    return parts.ema.checkpointable() if parts.ema is not None else None


def resume(resume_flag: str, backend, run: RunDir, ema: EMA | None = None) -> Position:
    """The position of the checkpoint --resume names (or, for 'auto', the newest one that loads), else step 0;
    `ema` is read from it too, or restarts from the resumed weights where it holds none."""
    for candidate in resolve_resume(resume_flag, run.checkpoints):
        try:
            pos = Position(**backend.load_checkpoint(candidate))
        except (ValueError, FileNotFoundError, KeyError, TypeError) as e:  # damaged: fall back to an older one
            run.print(f"skipping checkpoint {candidate}: {e}")
            continue
        run.print(f"resumed from {candidate} at step {pos.step}")
        if ema is not None and "ema" not in backend.load_extra(candidate, ema.checkpointable()):
            ema.restart()
            run.print(f"{candidate} holds no EMA (trained without --ema): the EMA starts from its weights")
        return pos
    if resume_flag and resume_flag != "auto":
        raise ValueError(f"--resume {resume_flag}: the checkpoint could not be loaded (see above)")
    return Position()


def write_samples(task: Task, model, backend, path: str, step: int, run) -> None:
    """Every rank generates (sharded parameters need every rank to gather); rank 0 writes."""
    with whole_model(backend, model) as module:
        task.write_samples(module, step, path if backend.is_main else None)
    if backend.is_main and os.path.exists(path):
        run.log_image(step, "samples", path)


def export(task: Task, model, backend, run, ema: EMA | None = None) -> None:
    weights = backend.full_state_dict(model)  # collective: gathers shards on every rank
    average = ema.export() if ema is not None else None  # collective too
    if backend.is_main:
        task.export(weights, average)
        run.log_artifact(task.export_path)
    backend.barrier()


__all__ = ["Position", "ShardedSampler", "param_groups", "train"]
