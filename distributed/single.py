"""One process, no communication. The other torch-based backends extend it with their wrappers."""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .base import Backend
from .checkpoint_io import load_rank_file, load_shared_file, save_rank_file, save_shared_file


class SingleBackend(Backend):
    name = "single"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.model = self.optimizer = self.scheduler = None
        self.scaler = None

    def setup(self) -> None:
        self.device = self._pick_device()

    def teardown(self) -> None:
        pass

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def prepare(self, model, make_optimizer, make_scheduler, activation_bytes: float = 0.0):
        model = self.wrap_model(model.to(self.device))
        optimizer = self.wrap_optimizer(make_optimizer(model), model)
        scheduler = make_scheduler(optimizer)
        # fp16 needs loss scaling: gradients of small losses underflow in half precision. GradScaler
        # raises the scale until an overflow, then skips that step and halves it (dynamic loss scaling).
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        return model, optimizer, scheduler

    def wrap_optimizer(self, optimizer, model):
        return optimizer

    def accumulate(self, model, sync: bool):
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss / self.accumulation_steps).backward()

    def synchronize_gradients(self) -> None:
        """Make every rank's gradients the global average before clipping (DDP already did in backward)."""

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def after_synchronize(self):
        """Context around the optimizer step once gradients are synchronized (Horovod must not redo it)."""
        return contextlib.nullcontext()

    def clip_gradients(self) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.clip_grad_norm if self.clip_grad_norm > 0 else float("inf")
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.synchronize_gradients()
        self.scaler.unscale_(self.optimizer)
        norm = self.clip_gradients()
        scale_before = self.scaler.get_scale() if self.scaler.is_enabled() else None
        with self.after_synchronize():
            self.scaler.step(self.optimizer)  # skips the step when the unscaled gradients hold inf/nan
        self.scaler.update()
        self.zero_grad()
        self.scheduler.step()
        if scale_before is None:
            skipped = torch.zeros((), dtype=torch.bool)
        else:  # the scale only drops on a skipped step
            skipped = torch.tensor(self.scaler.get_scale() < scale_before)
        return norm.detach(), skipped

    def loss_scale(self) -> float:
        return self.scaler.get_scale() if self.scaler is not None and self.scaler.is_enabled() else 1.0

    # collectives are identities on one process
    def all_reduce(self, tensor, op="mean"):
        return tensor

    def broadcast_object(self, obj, src=0):
        return obj

    def barrier(self) -> None:
        pass

    # Resume checkpoints: model and optimizer through torch.distributed.checkpoint (DCP), whose files are
    # keyed by parameter name and resharded on load, so a checkpoint from any of the torch backends
    # (single, DDP, FSDP, Horovod) at any world size resumes on any other. Scheduler, scaler and loop
    # state go to one small file from rank 0, RNG states to one file per rank.
    def _writes_dcp(self) -> bool:
        """With a torch process group DCP coordinates every rank's writes; without one (Horovod), the
        states are replicated and rank 0 alone writes them."""
        return dist.is_initialized() or self.is_main

    def init_optimizer_state(self) -> None:
        """Create the optimizer's state tensors so that loading has a template (DCP's own way, a step on
        zero gradients, is run by get_optimizer_state_dict when the state is empty; the weights it moves are
        overwritten by the load)."""

    def save_checkpoint(self, directory: str, state: dict) -> None:
        to_save = {"model": get_model_state_dict(self.model)}
        # before the first step the optimizer has no state, and get_optimizer_state_dict would create it
        # by running optimizer.step() on zero gradients, which moves the weights (weight decay, Adam's step)
        has_optimizer_state = len(self.optimizer.state) > 0
        if has_optimizer_state:
            to_save["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        if self._writes_dcp():
            dcp.save(to_save, checkpoint_id=os.path.join(directory, "dcp"), no_dist=not dist.is_initialized())
        if self.is_main:
            shared = {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict()}
            save_shared_file(directory, {**shared, "state": state, "has_optimizer_state": has_optimizer_state})
        save_rank_file(directory, self.rank)

    def load_checkpoint(self, directory: str) -> dict:
        shared = load_shared_file(directory)
        if not os.path.isdir(os.path.join(directory, "dcp")):
            raise ValueError(f"{directory} has no dcp/ folder: it was written before checkpoints were portable")
        sd = {"model": get_model_state_dict(self.model)}
        if shared["has_optimizer_state"]:
            self.init_optimizer_state()
            sd["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        dcp.load(sd, checkpoint_id=os.path.join(directory, "dcp"), no_dist=not dist.is_initialized())
        set_model_state_dict(self.model, sd["model"])  # after the optimizer's initializing step above
        if shared["has_optimizer_state"]:
            set_optimizer_state_dict(self.model, self.optimizer, sd["optimizer"])
        self.scheduler.load_state_dict(shared["scheduler"])
        self.scaler.load_state_dict(shared["scaler"])
        if os.path.exists(os.path.join(directory, f"rng-rank{self.rank}.pt")):  # absent at a larger world size
            load_rank_file(directory, self.rank)
        self.barrier()
        return shared["state"]

    def full_state_dict(self, model) -> dict | None:
        if not self.is_main:
            return None
        return {k: v.detach().cpu() for k, v in self.unwrap(model).state_dict().items()}
