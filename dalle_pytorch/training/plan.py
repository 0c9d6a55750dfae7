"""What a run works out once, before the data and the models load, and passes down (torchtitan's "validate
once, then pass the result"): the validated flags, this process's place in the job, the backend that will run
it with its own options, and the micro-batches per optimizer step; the optimizer steps of the run once the data
is counted (`counted`).

The entry point makes the plan (arguments.run_fit), so a launch that cannot work (another backend's flag, a
--global_batch_size that the ranks cannot divide) is one line before any model loads or downloads; everything
below reads the plan, and nothing computes these again.
A Ray Train worker moves the driver's plan to its own place in the job (`on`): the flags were validated by the
driver. An elastic Horovod run keeps its plan while workers come and go: it refuses --global_batch_size and
--epochs (TrainConfig.check_elastic), so neither the accumulation (1) nor the steps (--steps) depend on the number
of workers; the batch of one optimizer step does, `global_batch(world_size)`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from distributed import StepOptions, Topology, applicable_options, resolve_backend, topology_from_env

from ..data import shard_plan
from ..data.stream import is_stream
from .batches import ShardedSampler
from .configs import TrainConfig


@dataclass(frozen=True)
class RunPlan:
    cfg: TrainConfig  # validated
    topo: Topology  # this process's place, as its launcher says (the Ray driver's: its smallest worker group)
    backend: str  # the backend's name ('auto' resolved for the launcher)
    backend_options: dict  # that backend's own options alone, by its name (make_backend's keywords)
    accumulation: int  # micro-batches per optimizer step: batch_size x world size x this = --global_batch_size
    steps: int = 0  # optimizer steps of the run; 0 until `counted`

    @classmethod
    def make(cls, cfg: TrainConfig, backend_options: dict | None = None, topo: Topology | None = None) -> RunPlan:
        """Validate the flags (one line naming the flag to change) and plan the run where `topo` (default: the
        launcher's environment) places this process."""
        cfg.validate()
        return cls._at(cfg, backend_options or {}, topo or topology_from_env())

    @classmethod
    def _at(cls, cfg: TrainConfig, backend_options: dict, topo: Topology) -> RunPlan:
        accumulation = cfg.accumulation_steps(topo.world_size)  # says which --global_batch_size to change
        backend = resolve_backend(cfg.distributed_backend, topo)
        options = applicable_options(backend, backend_options)  # another backend's flag: refused in one line
        return cls(cfg, topo, backend, options, accumulation)

    def on(self, topo: Topology, **changes) -> RunPlan:
        """The same (validated) flags, with `changes`, planned where `topo` places this process."""
        return self._at(dataclasses.replace(self.cfg, **changes), self.backend_options, topo)

    def step_options(self) -> StepOptions:
        """What the backend needs to know of each optimizer step."""
        cfg = self.cfg
        return StepOptions(
            precision=cfg.precision,
            accumulation_steps=self.accumulation,
            clip_grad_norm=cfg.clip_grad_norm,
            initial_scale_power=cfg.initial_scale_power,
            loss_scale_window=cfg.loss_scale_window,
            dist_timeout=cfg.dist_timeout,
        )

    def global_batch(self, world_size: int) -> int:
        """Samples of one optimizer step on `world_size` ranks."""
        return self.cfg.batch_size * world_size * self.accumulation

    def counted(self, dataset) -> RunPlan:
        """The plan with the run's optimizer steps: --steps, or --epochs over each rank's share of `dataset` (of a
        stream: its counted samples, split into equal streams per rank and loader worker)."""
        cfg, world = self.cfg, self.topo.world_size
        if cfg.steps:
            return dataclasses.replace(self, steps=cfg.steps)
        if is_stream(dataset):
            workers = max(cfg.num_workers, 1)
            per_rank = shard_plan.stream_length([(0, dataset.num_samples)], world * workers, cfg.batch_size) * workers
        else:
            per_rank = ShardedSampler.shard_size(len(dataset), world, cfg.batch_size)
        return dataclasses.replace(self, steps=cfg.epochs * max(per_rank // cfg.batch_size // self.accumulation, 1))

    def derived(self, world_size: int) -> dict:
        """What config.json records of the plan (beside the flags)."""
        return {
            "backend": self.backend,
            "launcher": self.topo.launcher,
            "world_size": world_size,
            "accumulation_steps": self.accumulation,
            "global_batch_size": self.global_batch(world_size),
        }
