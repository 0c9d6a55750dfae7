"""torch FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over the ranks.

Each block of every nn.ModuleList is sharded on its own (its parameters are gathered just for its
forward and backward), then the root. Resume checkpoints use torch.distributed.checkpoint (DCP), which
writes one shard per rank and reshards on load.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from .checkpoint_io import load_rank_file, load_shared_file, save_rank_file, save_shared_file
from .torch_ddp import DDPBackend


class FSDPBackend(DDPBackend):
    name = "fsdp"

    def wrap_model(self, model: nn.Module) -> nn.Module:
        # autocast handles bf16/fp16 compute, as on every other backend; FSDP keeps fp32 parameters
        mp = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None)
        for module in list(model.modules()):
            if isinstance(module, nn.ModuleList):
                for block in module:
                    fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model

    def unwrap(self, model):
        return model

    def accumulate(self, model, sync: bool):
        model.set_requires_gradient_sync(sync)  # non-final micro-batches keep unreduced gradients
        return contextlib.nullcontext()

    def clip_gradients(self) -> torch.Tensor:
        norm = super().clip_gradients()
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    @contextlib.contextmanager
    def full_params(self, model):
        modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for m in modules:
            m.unshard()
        try:
            yield model
        finally:
            for m in modules:
                m.reshard()

    def save_checkpoint(self, directory: str, state: dict) -> None:
        opts = StateDictOptions()
        to_save = {"model": get_model_state_dict(self.model, options=opts)}
        # before the first step the optimizer has no state, and get_optimizer_state_dict would create it
        # by running optimizer.step() on zero gradients, which moves the weights (weight decay, Adam's step)
        has_optimizer_state = len(self.optimizer.state) > 0
        if has_optimizer_state:
            to_save["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer, options=opts)
        dcp.save(to_save, checkpoint_id=f"{directory}/dcp")
        if self.is_main:
            save_shared_file(
                directory,
                {
                    "scheduler": self.scheduler.state_dict(),
                    "scaler": self.scaler.state_dict(),
                    "state": state,
                    "has_optimizer_state": has_optimizer_state,
                },
            )
        save_rank_file(directory, self.rank)

    def load_checkpoint(self, directory: str) -> dict:
        opts = StateDictOptions()
        shared = load_shared_file(directory)
        sd = {"model": get_model_state_dict(self.model, options=opts)}
        if shared["has_optimizer_state"]:
            sd["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer, options=opts)
        dcp.load(sd, checkpoint_id=f"{directory}/dcp")
        set_model_state_dict(self.model, sd["model"], options=opts)  # after the optimizer's initializing step
        if shared["has_optimizer_state"]:
            set_optimizer_state_dict(self.model, self.optimizer, sd["optimizer"], options=opts)
        self.scheduler.load_state_dict(shared["scheduler"])
        self.scaler.load_state_dict(shared["scaler"])
        load_rank_file(directory, self.rank)
        self.barrier()
        return shared["state"]

    def full_state_dict(self, model):
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return full if self.is_main else None
