"""torch.distributed DistributedDataParallel, launched by torchrun (or SLURM / a hand-made env)."""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from .base import Backend, Workload
from .torch_parts import destroy_process_group, init_process_group, torch_parts


class DDPBackend(Backend):
    name = "ddp"

    def setup(self) -> None:
        super().setup()
        self._collectives = init_process_group(self.topo, self.device, self._opts.dist_timeout)

    def teardown(self) -> None:
        destroy_process_group(self._collectives)

    def prepare(self, model, make_optimizer, make_scheduler, workload: Workload = Workload()):
        ids = [self.device.index] if self.device.type == "cuda" else None
        model = DistributedDataParallel(model.to(self.device), device_ids=ids)
        self._stepper, self._checkpointer = torch_parts(self, model, make_optimizer, make_scheduler)
        return model, self._stepper.optimizer, self._stepper.scheduler

    def accumulate(self, model, sync: bool):
        # no_sync: gradients of non-final micro-batches stay local, one all-reduce per optimizer step
        return super().accumulate(model, sync) if sync else model.no_sync()
