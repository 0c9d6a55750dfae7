"""The parts the torch-optimizer backends (single, DDP, FSDP, Horovod) share: the optimizer step with
torch's GradScaler, resume checkpoints through torch.distributed.checkpoint, and the collectives of a
torch.distributed process group (DeepSpeed uses those too)."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .base import Backend, StepOptions, StepResult
from .checkpoint_io import load_rank_file, load_shared_file, save_rank_file, save_shared_file
from .watchdog import Heartbeat


class TorchStepper:
    """backward() and step() for a torch optimizer. `synchronize` makes the gradients the global average
    before they are unscaled and clipped (DDP and FSDP did it in backward; Horovod waits for its allreduce
    here); `stepping` wraps the optimizer step once they are (Horovod must not synchronize again)."""

    def __init__(
        self,
        model,
        optimizer,
        scheduler,
        opts: StepOptions,
        device: torch.device,
        synchronize: Callable[[], None] = lambda: None,
        stepping: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):
        self.model, self.optimizer, self.scheduler, self._opts = model, optimizer, scheduler, opts
        self.synchronize, self.stepping = synchronize, stepping
        # fp16 needs loss scaling: gradients of small losses underflow in half precision. GradScaler raises
        # the scale every loss_scale_window steps without overflow; an overflow skips the step and halves it.
        self.scaler = torch.amp.GradScaler(
            device.type,
            init_scale=2.0**opts.initial_scale_power,
            growth_interval=opts.loss_scale_window,
            enabled=opts.precision == "fp16",
        )

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss / self._opts.accumulation_steps).backward()

    def step(self) -> StepResult:
        self.synchronize()
        self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self._opts.clip_grad_norm if self._opts.clip_grad_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: a DTensor
        scale_before = self.loss_scale()
        with self.stepping():
            self.scaler.step(self.optimizer)  # skips the step when the unscaled gradients hold inf/nan
        self.scaler.update()
        self.optimizer.zero_grad()
        self.scheduler.step()
        scale = self.loss_scale()
        return StepResult(norm.detach(), torch.tensor(scale < scale_before), scale)  # the scale drops only on a skip

    def loss_scale(self) -> float:
        return self.scaler.get_scale() if self.scaler.is_enabled() else 1.0


class TorchCheckpointer:
    """Model and optimizer through torch.distributed.checkpoint (DCP): every rank writes its own shards, keyed
    by parameter name, and DCP reshards on load, so a checkpoint of any torch backend at any world size resumes
    on any other (and under DeepSpeed, whose portable form is the same layout). Scheduler, scaler and the
    loop's state go to one small file from rank 0, RNG states to one file per rank.

    `writes`: whether this rank takes part in DCP's save; without a process group (Horovod, one process) the
    states are replicated and rank 0 alone writes them. `init_optimizer_state` creates the optimizer's state
    before a load (DCP's own way, a step on zero gradients, moves weights that the load then overwrites)."""

    def __init__(self, model, optimizer, stepper: TorchStepper, rank: int, barrier, init_optimizer_state=None):
        self.model, self.optimizer, self.stepper, self.rank, self.barrier = model, optimizer, stepper, rank, barrier
        self.init_optimizer_state = init_optimizer_state or (lambda: None)

    def _dcp(self, directory: str) -> dict:
        return {"checkpoint_id": os.path.join(directory, "dcp"), "no_dist": not dist.is_initialized()}

    def save(self, directory: str, state: dict, extra: dict | None = None) -> None:
        to_save = {"model": get_model_state_dict(self.model), **(extra or {})}
        # before the first step the optimizer has no state, and get_optimizer_state_dict would create it
        # by running optimizer.step() on zero gradients, which moves the weights (weight decay, Adam's step)
        has_optimizer_state = len(self.optimizer.state) > 0
        if has_optimizer_state:
            to_save["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        if dist.is_initialized() or self.rank == 0:
            dcp.save(to_save, **self._dcp(directory))
        if self.rank == 0:
            save_shared_file(
                directory,
                {
                    "scheduler": self.stepper.scheduler.state_dict(),
                    "scaler": self.stepper.scaler.state_dict(),
                    "state": state,
                    "has_optimizer_state": has_optimizer_state,
                },
            )
        save_rank_file(directory, self.rank)

    def load(self, directory: str) -> dict:
        shared = load_shared_file(directory)
        if not os.path.isdir(os.path.join(directory, "dcp")):
            raise ValueError(f"{directory} has no dcp/ folder: it holds no resume checkpoint")
        sd = {"model": get_model_state_dict(self.model)}
        if shared["has_optimizer_state"]:
            self.init_optimizer_state()
            sd["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        dcp.load(sd, **self._dcp(directory))
        set_model_state_dict(self.model, sd["model"])  # after the optimizer's initializing step above
        if shared["has_optimizer_state"]:
            set_optimizer_state_dict(self.model, self.optimizer, sd["optimizer"])
        self.stepper.scheduler.load_state_dict(shared["scheduler"])
        self.stepper.scaler.load_state_dict(shared["scaler"])
        load_rank_file(directory, self.rank)
        self.barrier()
        return shared["state"]


class ProcessGroup:
    """Collectives over torch.distributed (NCCL on GPUs, Gloo on CPUs)."""

    def __init__(self, world_size: int, device: torch.device = torch.device("cpu"), timeout_s: float = 300.0):
        self.world_size = world_size
        self._heartbeat = Heartbeat(dist.get_rank(), world_size, timeout_s) if world_size > 1 else None
        # control flags (the stop vote) travel as CPU tensors through a Gloo group of their own (made here, on
        # every rank at once, as new_group requires): on GPUs waiting for one never waits for the CUDA stream, and
        # on CPUs it does not queue behind the gradients' reductions in the main group's worker threads, which
        # cost a step about 1 ms here (bench/stop_vote.py: +1.1 ms on a 20 ms step in the main group, none apart)
        self._cpu_group = dist.new_group(backend="gloo") if world_size > 1 else None

    def all_reduce(self, tensor, op="mean"):
        if op not in ("mean", "sum"):
            raise ValueError(f"unknown reduce op {op!r}")
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        if op == "mean":
            tensor /= self.world_size
        return tensor

    def all_reduce_async(self, tensor, op="sum"):
        if op not in ("mean", "sum"):
            raise ValueError(f"unknown reduce op {op!r}")
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._cpu_group, async_op=True)

        def result():
            work.wait()
            return tensor / self.world_size if op == "mean" else tensor

        return result

    def all_gather(self, tensor):
        import torch.distributed.nn.functional as dist_nn  # the differentiable collectives

        return torch.cat(dist_nn.all_gather(tensor.contiguous()), dim=0)

    def barrier(self) -> None:
        dist.barrier()

    def explain(self, error):
        return self._heartbeat.explain(error) if self._heartbeat else None

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.close()
            self._heartbeat = None


def export_launcher_env(topo) -> None:
    """env:// lets torchrun hand over its own store (and a fresh one after a restart); SLURM and mpirun only
    describe the topology, so the variables are filled from it."""
    for key, value in (
        ("MASTER_ADDR", topo.master_addr),
        ("MASTER_PORT", topo.master_port),
        ("RANK", topo.rank),
        ("WORLD_SIZE", topo.world_size),
        ("LOCAL_RANK", topo.local_rank),
    ):
        os.environ.setdefault(key, str(value))


class ProcessGroupBackend(Backend):
    """A backend over a torch.distributed process group (DDP, FSDP): joins it in setup, leaves it in teardown."""

    def setup(self) -> None:
        super().setup()
        self._collectives = init_process_group(self.topo, self.device, self._opts.dist_timeout)

    def teardown(self) -> None:
        destroy_process_group(self._collectives)


def init_process_group(topo, device: torch.device, timeout_s: float) -> ProcessGroup:
    if not dist.is_initialized():
        export_launcher_env(topo)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method="env://",
            rank=topo.rank,
            world_size=topo.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return ProcessGroup(topo.world_size, device, timeout_s)


def destroy_process_group(collectives=None) -> None:
    """Leave the process group; first stop the heartbeat of `collectives` (a ProcessGroup), whose thread must
    not reach the store while the group is torn down (an abort, 'terminate called', exit -6)."""
    if isinstance(collectives, ProcessGroup):
        collectives.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def torch_parts(
    backend, model, make_optimizer, make_scheduler, init_optimizer_state=None, **stepping
) -> tuple[TorchStepper, TorchCheckpointer]:
    """A TorchStepper and a TorchCheckpointer over an optimizer and scheduler built on the (wrapped) model, for
    `backend` to keep. `stepping`: TorchStepper's synchronize / stepping hooks."""
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer)
    stepper = TorchStepper(model, optimizer, scheduler, backend._opts, backend.device, **stepping)
    return stepper, TorchCheckpointer(model, optimizer, stepper, backend.rank, backend.barrier, init_optimizer_state)
