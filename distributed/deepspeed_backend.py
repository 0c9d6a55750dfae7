"""DeepSpeed: ZeRO stages 0-3, CPU offload, DeepSpeed's own loss scaler, driven by our flags.

The engine owns accumulation, loss scaling, clipping and the step; the config comes from
`deepspeed_config.build_config`. Launched by `deepspeed` (or torchrun with --distributed_backend deepspeed).
"""

from __future__ import annotations

import contextlib
import os

import deepspeed
import torch
import torch.distributed.checkpoint as dcp
from deepspeed.runtime.zero.partition_parameters import GatheredParameters

from . import deepspeed_portable as portable
from .checkpoint_io import load_rank_file, load_shared_file, save_rank_file, save_shared_file
from .deepspeed_config import build_config, choose_zero_stage, read_user_config
from .torch_ddp import DDPBackend

TAG = "deepspeed"


def free_device_bytes(local_world_size: int) -> float:
    """Free memory of this process's device; on CPU, this process's share of the available RAM."""
    if torch.cuda.is_available():
        return float(torch.cuda.mem_get_info()[0])
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info.get("MemAvailable", info["MemTotal"]) / max(local_world_size, 1)


class DeepSpeedBackend(DDPBackend):
    name = "deepspeed"

    def setup(self) -> None:
        self.device = self._pick_device()
        os.environ.setdefault("MASTER_ADDR", self.topo.master_addr)
        os.environ.setdefault("MASTER_PORT", str(self.topo.master_port))
        os.environ.setdefault("RANK", str(self.rank))
        os.environ.setdefault("WORLD_SIZE", str(self.world_size))
        os.environ.setdefault("LOCAL_RANK", str(self.local_rank))
        if not torch.distributed.is_initialized():
            deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo", verbose=False)

    def autocast(self):
        return contextlib.nullcontext()  # the engine applies bf16 / fp16 itself, from the config

    def prepare(self, model, make_optimizer, make_scheduler, activation_bytes: float = 0.0):
        opts = self.options
        stage = opts.zero_stage
        if stage == "auto":
            n = sum(p.numel() for p in model.parameters() if p.requires_grad)
            stage, estimates = choose_zero_stage(
                n, activation_bytes, free_device_bytes(self.topo.local_world_size), self.world_size, self.precision
            )
            if self.is_main:
                table = ", ".join(f"ZeRO-{s} {b / 2**20:.1f} MiB" for s, b in estimates)
                print(f"--zero_stage auto: chose ZeRO-{stage} (per-device estimates: {table})", flush=True)
        self.zero_stage = int(stage)
        config, conflicts = build_config(
            micro_batch=opts.batch_size,
            accumulation_steps=self.accumulation_steps,
            world_size=self.world_size,
            clip_grad_norm=self.clip_grad_norm,
            precision=self.precision,
            zero_stage=self.zero_stage,
            offload_optimizer=opts.offload_optimizer,
            offload_params=opts.offload_params,
            initial_scale_power=opts.initial_scale_power,
            loss_scale_window=opts.loss_scale_window,
            hysteresis=opts.hysteresis,
            min_loss_scale=opts.min_loss_scale,
            on_gpu=self.device.type == "cuda",
            user_config=read_user_config(opts.deepspeed_config),
        )
        if self.is_main:
            for line in conflicts:
                print(f"warning: {line}", flush=True)
        model = model.to(self.device)
        client_optimizer = make_optimizer(model)
        self._group_names = portable.group_names(model, client_optimizer)  # before ZeRO flattens the groups
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, optimizer=client_optimizer, lr_scheduler=make_scheduler, config=config
        )
        self.engine, self.model, self.optimizer, self.scheduler = engine, engine, optimizer, scheduler
        return engine, optimizer, scheduler

    def accumulate(self, model, sync: bool):
        return contextlib.nullcontext()  # the engine reduces only at the accumulation boundary

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)  # divides by gradient_accumulation_steps and applies the loss scale
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()  # advances the engine's micro-step counter; no optimizer step

    def step(self):
        skipped_before = self.engine.skipped_steps
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = torch.tensor(float("nan") if norm is None else float(norm))
        return norm, torch.tensor(self.engine.skipped_steps > skipped_before)

    def loss_scale(self) -> float:
        opt = self.engine.optimizer
        return float(getattr(opt, "cur_scale", getattr(opt, "loss_scale", 1.0)) or 1.0)

    @contextlib.contextmanager
    def full_params(self, model):
        module = self.unwrap(model)
        if self.zero_stage == 3:
            with GatheredParameters(list(module.parameters()), modifier_rank=None):
                yield module
        else:
            yield module

    # Resume checkpoints, two forms side by side. DeepSpeed's own (flat per-rank partitions) resumes
    # exactly and fast at the same world size and ZeRO stage. The portable form (deepspeed_portable.py)
    # is the layout the torch and Horovod backends write: full tensors by parameter name through DCP,
    # gathered to rank 0, which reshards to any backend, world size or stage.
    def save_checkpoint(self, directory: str, state: dict) -> None:
        self.engine.save_checkpoint(directory, tag=TAG, client_state={"state": state}, save_latest=False)
        with_optimizer = portable.has_state(self.engine.optimizer)
        module = self.unwrap(self.engine)
        model_sd, optim_sd = portable.gather(
            module, self.engine.optimizer, self._group_names, with_optimizer, keep=self.is_main
        )
        if self.is_main:
            to_save = {"model": model_sd} if optim_sd is None else {"model": model_sd, "optimizer": optim_sd}
            dcp.save(to_save, checkpoint_id=os.path.join(directory, "dcp"), no_dist=True)
            save_shared_file(
                directory,
                {
                    "scheduler": self.scheduler.state_dict(),
                    "scaler": self._scaler_state(),
                    "state": state,
                    "has_optimizer_state": with_optimizer,
                    "deepspeed": self._layout(),
                },
            )
        save_rank_file(directory, self.rank)

    def _layout(self) -> dict:
        """What DeepSpeed's own checkpoint needs to match to be loadable."""
        return {"world_size": self.world_size, "zero_stage": self.zero_stage}

    def load_checkpoint(self, directory: str) -> dict:
        native = os.path.isdir(os.path.join(directory, TAG))
        if native and not os.path.exists(os.path.join(directory, "states.pt")):  # written before the portable copy
            shared = {"deepspeed": self._layout()}
        else:
            shared = load_shared_file(directory)
        if native and shared.get("deepspeed") == self._layout():
            path, client = self.engine.load_checkpoint(directory, tag=TAG)
            if path is None:
                raise ValueError(f"{directory} holds no DeepSpeed checkpoint (tag {TAG})")
            shared.setdefault("state", client["state"])
        else:
            self._load_portable(directory, shared)
        if os.path.exists(os.path.join(directory, f"rng-rank{self.rank}.pt")):  # absent at a larger world size
            load_rank_file(directory, self.rank)
        self.barrier()
        return shared["state"]

    def _load_portable(self, directory: str, shared: dict) -> None:
        if not os.path.isdir(os.path.join(directory, "dcp")):
            raise ValueError(f"{directory} has no dcp/ folder: it holds no portable checkpoint")
        portable.load(
            self.unwrap(self.engine),
            self.engine.optimizer,
            self._group_names,
            os.path.join(directory, "dcp"),
            shared["has_optimizer_state"],
            self.zero_stage,
        )
        self.scheduler.load_state_dict(shared["scheduler"])
        if self.precision == "fp16" and shared["scaler"]:
            self.engine.optimizer.loss_scaler.cur_scale = float(shared["scaler"]["scale"])
        if self.is_main:
            print(f"{directory}: loaded the portable (resharded) checkpoint on ZeRO-{self.zero_stage}", flush=True)

    def _scaler_state(self) -> dict:
        """DeepSpeed's dynamic loss scale as torch's GradScaler.state_dict() writes it (empty unless fp16)."""
        if self.precision != "fp16":
            return {}
        return {
            "scale": self.loss_scale(),
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": self.options.loss_scale_window,
            "_growth_tracker": 0,
        }

    def full_state_dict(self, model):
        module = self.unwrap(model)
        with self.full_params(model):
            sd = {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()} if self.is_main else None
        self.barrier()
        return sd
