"""The Backend interface the training loop talks to. One subclass per backend, one file each.

Shaped after DeepSpeed's engine (it owns loss scaling, accumulation and the step), which every other
backend can express, so the loop never asks which backend it has.
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod

import torch

from arguments import Topology


class Backend(ABC):
    name: str = "base"

    def __init__(
        self,
        topo: Topology,
        precision: str = "fp32",
        accumulation_steps: int = 1,
        clip_grad_norm: float = 0.0,
        options=None,
    ):
        self.topo = topo
        self.options = options  # the run's TrainConfig: backend-specific flags (zero_stage, compression, ...)
        self.precision = precision
        self.accumulation_steps = accumulation_steps
        self.clip_grad_norm = clip_grad_norm
        self.device = torch.device("cpu")

    # ---------------------------------------------------------------- topology
    @property
    def rank(self) -> int:
        return self.topo.rank

    @property
    def world_size(self) -> int:
        return self.topo.world_size

    @property
    def local_rank(self) -> int:
        return self.topo.local_rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _pick_device(self) -> torch.device:
        if torch.cuda.is_available():
            torch.cuda.set_device(self.local_rank % torch.cuda.device_count())
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def set_threads(self, threads: int) -> None:
        """Split the CPU cores among the local ranks so they do not oversubscribe the machine."""
        if threads <= 0:
            threads = max(1, (os.cpu_count() or 1) // max(self.topo.local_world_size, 1))
        torch.set_num_threads(threads)

    # ---------------------------------------------------------------- lifecycle
    @abstractmethod
    def setup(self) -> None:
        """Join the process group from the launcher's environment and set the device; safe to call twice."""

    @abstractmethod
    def teardown(self) -> None:
        """Leave the process group; safe to call twice."""

    # ---------------------------------------------------------------- training
    @abstractmethod
    def prepare(self, model, make_optimizer, make_scheduler, activation_bytes: float = 0.0):
        """Wrap the model, then build the optimizer on the wrapped parameters and the scheduler on it
        (FSDP and ZeRO replace parameters, so an optimizer built earlier would hold stale ones).
        Returns (model, optimizer, scheduler) to use from then on."""

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's module without wrappers."""
        return getattr(model, "module", model)

    @contextlib.contextmanager
    def full_params(self, model):
        """Collective context: the unwrapped module with every parameter whole (gathered where sharded),
        for sampling during training. Every rank enters it; non-sharding backends just unwrap."""
        yield self.unwrap(model)

    def autocast(self):
        """Mixed-precision context for the forward pass; the frozen VAE runs outside it, in fp32."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    @abstractmethod
    def accumulate(self, model, sync: bool):
        """Context for forward and backward of one micro-batch; sync=False defers gradient communication."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` divided by the accumulation steps, with loss scaling where the precision needs it."""

    @abstractmethod
    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscale, synchronize, clip, step, zero grads, step the scheduler.

        Returns (grad norm, skipped) as tensors, so the loop reads them only when it logs.
        """

    def loss_scale(self) -> float:
        return 1.0

    @property
    def world_size_may_change(self) -> bool:
        """True for elastic runs, where workers come and go while training."""
        return False

    def run(self, steps, pos):
        """Run `steps(pos)` (the loop from `pos` to the end) and return its final position. An elastic backend
        calls it again after workers were lost or added, from the position of its last commit."""
        return steps(pos)

    def commit(self, pos) -> None:
        """After each step: an elastic backend keeps an in-memory copy of the training state to roll back to."""
        return None

    # ---------------------------------------------------------------- collectives (every rank calls them)
    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce across ranks (in place where possible) and return the result; op is 'mean' or 'sum'."""

    @abstractmethod
    def broadcast_object(self, obj, src: int = 0):
        """`obj` from rank `src` on every rank."""

    @abstractmethod
    def barrier(self) -> None: ...

    # ---------------------------------------------------------------- checkpoints
    @abstractmethod
    def save_checkpoint(self, directory: str, state: dict) -> None:
        """Collective: write model, optimizer, scheduler, scaler and `state` into `directory`."""

    @abstractmethod
    def load_checkpoint(self, directory: str) -> dict:
        """Collective: restore model, optimizer, scheduler and scaler; returns the saved `state`."""

    @abstractmethod
    def full_state_dict(self, model) -> dict | None:
        """Unsharded weights (CPU tensors) on rank 0, None elsewhere. Collective."""
