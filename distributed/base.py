"""The Backend interface the training loop talks to, and the parts the backends are assembled from.

Shaped after DeepSpeed's engine (it owns loss scaling, accumulation and the step), which every other
backend can express, so the loop never asks which backend it has. A backend is a topology plus three
private parts: its collectives, its stepper (backward and the optimizer step) and its checkpointer;
prepare() wraps the model and assembles them. The torch backends share TorchStepper and TorchCheckpointer
(torch_parts.py); DeepSpeed's engine brings its own. Each backend also says how the loop is run
(recovery()): once, or again after an elastic change of workers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from .topology import Topology, pick_device


@dataclass(frozen=True)
class StepOptions:
    """What every backend's step needs from the run's flags."""

    precision: str = "fp32"  # fp32, bf16 (autocast) or fp16 (autocast and dynamic loss scaling)
    accumulation_steps: int = 1  # micro-batches per optimizer step
    clip_grad_norm: float = 0.0  # 0: no clipping
    initial_scale_power: int = 16  # fp16: the loss scale starts at 2**N
    loss_scale_window: int = 1000  # fp16: steps without overflow before the scale doubles
    dist_timeout: float = 300.0  # seconds a collective waits for every rank before the job stops


@dataclass(frozen=True)
class Workload:
    """What one micro-batch on this process is, handed to prepare() once: backends that size themselves to
    it read it (DeepSpeed's batch size in its config, and its memory estimate for --zero_stage auto)."""

    micro_batch: int = 1  # samples per micro-batch on this process
    activation_bytes: float = 0.0  # activation memory of one micro-batch (an estimate)


class StepResult(NamedTuple):
    grad_norm: torch.Tensor  # global norm before clipping, a tensor: read only when logging
    skipped: torch.Tensor  # bool tensor: fp16 overflow skipped the step
    loss_scale: float  # 1.0 unless fp16


class Collectives(Protocol):
    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor: ...
    def all_reduce_async(self, tensor: torch.Tensor, op: str = "sum") -> Callable[[], torch.Tensor]: ...
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def barrier(self) -> None: ...
    def explain(self, error: BaseException) -> str | None: ...


class Stepper(Protocol):
    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self) -> StepResult: ...


class Checkpointer(Protocol):
    def save(self, directory: str, state: dict, extra: dict | None = None) -> None: ...
    def load(self, directory: str) -> dict: ...


class Weights:
    """Each parameter's fp32 weights as this rank holds and steps them, by name: live tensors that every
    optimizer step updates in place. A replicated backend (one process, DDP, Horovod) holds every tensor whole;
    FSDP a DTensor shard of each (fsdp's FSDPWeights), DeepSpeed's ZeRO a flat fragment of its fp32 master copy
    (deepspeed_backend's ZeROWeights). A copy of each in the same layout (an EMA of the weights) is therefore
    sharded exactly as the weights are, and the two methods below checkpoint and export such copies."""

    def __init__(self, local: dict[str, torch.Tensor], backend: Backend):
        self.local, self._backend = local, backend  # the backend's rank, which an elastic run changes

    @property
    def is_main(self) -> bool:
        return self._backend.is_main

    def current(self) -> list[torch.Tensor]:
        """The weights now, as plain local tensors in `local`'s order."""
        return self.plain(self.local)

    def plain(self, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The local tensors (views) of `tensors`, in `local`'s order, for in-place foreach arithmetic."""
        return [tensors[k] for k in self.local]

    def checkpointable(self, tensors: dict[str, torch.Tensor]) -> dict:
        """Collective: `tensors` (in `local`'s layout) as torch.distributed.checkpoint saves them and loads
        into them in place, keyed by parameter name in full shapes, so they reshard like the weights."""
        return tensors

    def full(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Collective: `tensors` whole, on the CPU, on rank 0 (None elsewhere), for an export."""
        return {k: v.detach().cpu().clone() for k, v in tensors.items()} if self.is_main else None


class Local:
    """The collectives of one process: identities."""

    def all_reduce(self, tensor, op="mean"):
        if op not in ("mean", "sum"):
            raise ValueError(f"unknown reduce op {op!r}")
        return tensor

    def all_reduce_async(self, tensor, op="sum"):
        self.all_reduce(tensor, op)
        return lambda: tensor

    def all_gather(self, tensor):
        return tensor

    def barrier(self) -> None:
        pass

    def explain(self, error):
        return None


class Backend:
    """One process's view of the job. Subclasses implement setup() and prepare() and, where they wrap or shard
    the model, accumulate(), full_params() and full_state_dict(); an elastic one recovery(). The rest delegates
    to the parts, which only the backend itself sets."""

    name = "base"

    def __init__(self, topo: Topology, opts: StepOptions = StepOptions()):
        self.topo, self._opts = topo, opts
        self.device = torch.device("cpu")
        self._collectives: Collectives = Local()
        self._stepper: Stepper | None = None  # set by prepare()
        self._checkpointer: Checkpointer | None = None

    # ---------------------------------------------------------------- topology
    @property
    def rank(self) -> int:
        return self.topo.rank

    @property
    def world_size(self) -> int:
        return self.topo.world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---------------------------------------------------------------- lifecycle
    def setup(self) -> None:
        """Join the process group from the launcher's environment and set the device; safe to call twice."""
        self.device = pick_device(self.topo.local_rank)

    def teardown(self) -> None:
        """Leave the process group; safe to call twice."""

    def recovery(self) -> Recovery:
        """How the loop is run: once, unless the backend survives workers coming and going."""
        return Recovery()

    # ---------------------------------------------------------------- training
    def prepare(self, model, make_optimizer, make_scheduler, workload: Workload = Workload()):
        """Wrap the model, then build the optimizer on the wrapped parameters and the scheduler on it
        (FSDP and ZeRO replace parameters, so an optimizer built earlier would hold stale ones).
        `workload`: one micro-batch, for backends that size themselves to it.
        Returns (model, optimizer, scheduler) to use from then on."""
        raise NotImplementedError

    def _unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's module without wrappers."""
        return getattr(model, "module", model)

    def forward_watch(self, model) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
        """Where a rank's own forward time is read (the loop's per-rank figures): the user's module inside any
        wrapper, whose forward pre-hook runs after the wrapper's collective before it (DDP's buffer broadcast),
        and the submodules whose forward pre-hooks gather parameters inside the forward (FSDP's blocks, ZeRO-3's
        modules), whose time there is a wait for the other ranks. No gathering submodules by default."""
        return self._unwrap(model), []

    @contextlib.contextmanager
    def full_params(self, model):
        """Collective context: the unwrapped module with every parameter whole (gathered where sharded),
        for sampling during training. Every rank enters it."""
        yield self._unwrap(model)

    def autocast(self):
        """Mixed-precision context for the forward pass; the frozen VAE runs outside it, in fp32."""
        if self._opts.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self._opts.precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def accumulate(self, model, sync: bool):
        """Context for forward and backward of one micro-batch; sync=False defers gradient communication."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` divided by the accumulation steps, with loss scaling where the precision needs it."""
        self._stepper.backward(loss)

    def step(self) -> StepResult:
        """Unscale, synchronize, clip, step, zero grads, step the scheduler."""
        return self._stepper.step()

    # ---------------------------------------------------------------- collectives (every rank calls them)
    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce across ranks (in place where possible) and return the result; op is 'mean' or 'sum'."""
        return self._collectives.all_reduce(tensor, op)

    def all_reduce_async(self, tensor: torch.Tensor, op: str = "sum") -> Callable[[], torch.Tensor]:
        """Start reducing a small CPU tensor across ranks; returns a function that waits for the result and
        returns it. For control flags read a step later (the stop vote), so that no step waits on them: on
        GPUs they go through a Gloo group of their own, never queued behind the CUDA stream."""
        return self._collectives.all_reduce_async(tensor, op)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (the same shape on each), concatenated along dim 0 in rank order, with
        gradients: the backward pass sends each rank the sum of every rank's gradients for its rows, so
        data-parallel averaging gives the gradient of the mean loss (a contrastive loss over all ranks' pairs)."""
        return self._collectives.all_gather(tensor)

    def barrier(self) -> None:
        self._collectives.barrier()

    def explain(self, error: BaseException) -> str | None:
        """One line saying which ranks stopped answering when `error` is a collective that timed out after
        --dist_timeout (or lost a peer); None for any other error. Called on the ranks still running."""
        return self._collectives.explain(error)

    # ---------------------------------------------------------------- checkpoints (collective)
    def save_checkpoint(self, directory: str, state: dict, extra: dict | None = None) -> None:
        """Write model, optimizer, scheduler, loss scaler, RNG states and `state` into `directory`, shard-wise;
        `extra`: named sets of tensors in the layout of weights() (made checkpointable), written beside them."""
        self._checkpointer.save(directory, state, extra)

    def load_checkpoint(self, directory: str) -> dict:
        """Restore what save_checkpoint wrote (at any world size, from any backend); returns the saved `state`."""
        return self._checkpointer.load(directory)

    def load_extra(self, directory: str, extra: dict) -> list[str]:
        """Collective: read the sets of `extra` (name -> checkpointable tensors, loaded in place) that the
        checkpoint in `directory` holds, resharded; returns the names it held."""
        from .checkpoint_io import load_extra

        return load_extra(directory, extra)

    def weights(self, model) -> Weights:
        """The fp32 weights this rank steps, as live tensors in the backend's own sharding (after prepare())."""
        return Weights({n: p.detach() for n, p in self._unwrap(model).named_parameters()}, self)

    def full_state_dict(self, model) -> dict | None:
        """Unsharded weights (CPU tensors) on rank 0, None elsewhere, for the export. Collective."""
        if not self.is_main:
            return None
        return {k: v.detach().cpu() for k, v in self._unwrap(model).state_dict().items()}


class Recovery:
    """How the loop is run: once. An elastic backend's recovery (horovod_elastic.ElasticRecovery) runs it again
    from its last commit after workers were lost or added; the loop calls commit() after every step."""

    world_size_may_change = False

    def track(self, tensors: dict[str, torch.Tensor]) -> None:
        """Tensors the loop keeps beside the model (the EMA), which an elastic recovery rolls back with the
        model and hands to joining workers; call before drive()."""

    def drive(self, steps, pos):
        return steps(pos)

    def commit(self, pos) -> None:
        pass
