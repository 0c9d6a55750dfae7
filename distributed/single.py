"""One process, no communication: the model as it is, a torch optimizer, DCP checkpoints."""

from __future__ import annotations

from .base import Backend
from .torch_parts import attach_torch_parts


class SingleBackend(Backend):
    name = "single"

    def prepare(self, model, make_optimizer, make_scheduler, activation_bytes: float = 0.0):
        model = model.to(self.device)
        return attach_torch_parts(self, model, make_optimizer, make_scheduler)
