"""torch.distributed DistributedDataParallel, launched by torchrun (or SLURM / a hand-made env)."""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from .base import Workload
from .torch_parts import ProcessGroupBackend, torch_parts


class DDPBackend(ProcessGroupBackend):
    name = "ddp"

    def prepare(self, model, make_optimizer, make_scheduler, workload: Workload = Workload()):
        ids = [self.device.index] if self.device.type == "cuda" else None
        model = DistributedDataParallel(model.to(self.device), device_ids=ids)
        self._stepper, self._checkpointer = torch_parts(self, model, make_optimizer, make_scheduler)
        return model, self._stepper.optimizer, self._stepper.scheduler

    def accumulate(self, model, sync: bool):
        # no_sync: gradients of non-final micro-batches stay local, one all-reduce per optimizer step
        return super().accumulate(model, sync) if sync else model.no_sync()
