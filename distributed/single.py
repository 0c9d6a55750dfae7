"""One process, no communication: the model as it is, a torch optimizer, DCP checkpoints."""

from __future__ import annotations

from .base import Backend, Workload
from .torch_parts import torch_parts


class SingleBackend(Backend):
    name = "single"

    def prepare(self, model, make_optimizer, make_scheduler, workload: Workload = Workload()):
        model = model.to(self.device)
        self._stepper, self._checkpointer = torch_parts(self, model, make_optimizer, make_scheduler)
        return model, self._stepper.optimizer, self._stepper.scheduler
