"""torch FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over the ranks.

Each block of every nn.ModuleList is sharded on its own (its parameters are gathered just for its
forward and backward), then the root. Resume checkpoints use torch.distributed.checkpoint (DCP), which
writes one shard per rank and reshards on load.
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from .base import Weights, Workload
from .torch_parts import ProcessGroupBackend, torch_parts


def _check_unshared(blocks: nn.ModuleList) -> None:
    """Each block becomes its own FSDP unit: a parameter in two blocks would be sharded twice."""
    seen: set[int] = set()
    for block in blocks:
        mine = {id(p) for p in block.parameters()}
        if mine & seen:
            raise ValueError(
                "--distributed_backend fsdp shards each block on its own, so blocks cannot share weights "
                "(--shared_attn_ids, --shared_ff_ids): use --distributed_backend ddp, deepspeed or horovod"
            )
        seen |= mine


class FSDPWeights(Weights):
    """FSDP2's parameters are DTensors, each rank holding a shard of dim 0: the weights are those DTensors, whose
    local shards foreach arithmetic updates, which DCP saves and reshards, and which full_tensor() gathers."""

    def plain(self, tensors):
        return [tensors[k].to_local() for k in self.local]

    def full(self, tensors):
        full = {k: v.full_tensor().cpu() for k, v in tensors.items()}  # collective, in the same order on every rank
        return full if self.is_main else None


class FSDPBackend(ProcessGroupBackend):
    name = "fsdp"

    def prepare(self, model, make_optimizer, make_scheduler, workload: Workload = Workload()):
        model = model.to(self.device)
        # autocast handles bf16/fp16 compute, as on every other backend; FSDP keeps fp32 parameters
        mp = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None)
        for module in list(model.modules()):
            if isinstance(module, nn.ModuleList):
                _check_unshared(module)
                for block in module:
                    fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        self._stepper, self._checkpointer = torch_parts(self, model, make_optimizer, make_scheduler)
        return model, self._stepper.optimizer, self._stepper.scheduler

    def accumulate(self, model, sync: bool):
        model.set_requires_gradient_sync(sync)  # non-final micro-batches keep unreduced gradients
        return contextlib.nullcontext()

    def forward_watch(self, model):
        # each block's pre-forward hook all-gathers its parameters (waits for every rank)
        return model, [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]

    @contextlib.contextmanager
    def full_params(self, model):
        # whole until the context ends, even across forwards (which reshard after themselves in training) and
        # methods that are not forward (a decode step), which FSDP's hooks never see. The root keeps its
        # parameters after forward anyway (FSDP2's heuristic), so only the blocks are switched.
        modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        blocks = [m for m in modules if m is not model]
        for m in blocks:
            m.set_reshard_after_forward(False, recurse=False)
        for m in modules:
            m.unshard()
        try:
            yield model
        finally:
            for m in modules:
                m.reshard()
            for m in blocks:
                m.set_reshard_after_forward(True, recurse=False)

    def weights(self, model) -> FSDPWeights:
        return FSDPWeights({n: p.detach() for n, p in model.named_parameters()}, self)

    def full_state_dict(self, model):
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return full if self.is_main else None
