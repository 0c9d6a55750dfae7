"""torch.distributed DistributedDataParallel, launched by torchrun (or SLURM / a hand-made env)."""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from .base import Backend
from .torch_parts import attach_torch_parts, destroy_process_group, init_process_group


class DDPBackend(Backend):
    name = "ddp"

    def setup(self) -> None:
        super().setup()
        self.collectives = init_process_group(self.topo, self.device)

    def teardown(self) -> None:
        destroy_process_group()

    def prepare(self, model, make_optimizer, make_scheduler, activation_bytes: float = 0.0):
        ids = [self.device.index] if self.device.type == "cuda" else None
        model = DistributedDataParallel(model.to(self.device), device_ids=ids)
        return attach_torch_parts(self, model, make_optimizer, make_scheduler)

    def accumulate(self, model, sync: bool):
        # no_sync: gradients of non-final micro-batches stay local, one all-reduce per optimizer step
        return super().accumulate(model, sync) if sync else model.no_sync()
