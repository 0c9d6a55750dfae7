"""DeepSpeed: ZeRO stages 0-3, CPU offload, DeepSpeed's own loss scaler, driven by our flags.

The engine owns accumulation, loss scaling, clipping and the step; the config comes from
`deepspeed_config.build_config`. Launched by `deepspeed` (or torchrun with --distributed_backend deepspeed).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys

# DeepSpeed JIT-builds its ops into torch's extensions folder, which every Python environment of the user shares
# (~/.cache/torch_extensions): two checkouts, each with its .venv, then rebuild each other's op at every switch
# (2 minutes each). Each environment keeps its own, where scripts/warm_ops.py builds it at install time.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor

from .base import Backend, StepOptions, StepResult, Weights, Workload
from .checkpoint_io import load_rank_file, load_shared_file, save_rank_file, save_shared_file
from .deepspeed_config import (
    DeepSpeedOptions,
    build_config,
    check_precision,
    choose_zero_stage,
    fixed_zero_stage,
    hidden_module,
    json_zero_stage,
    offloads,
    read_user_config,
)
from .topology import Topology
from .torch_parts import ProcessGroup, destroy_process_group, export_launcher_env

# `import deepspeed` imports its autotuner, which imports mlflow when it is installed (our --mlflow extra) only to
# log autotuning experiments, which we never run: 1.3 s more at every rank's start. --mlflow imports it later.
with hidden_module("mlflow"):
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    from .deepspeed_portable import checkpointable, group_names, has_state, local_weights, sharded_state_dict
    from .deepspeed_portable import load as load_portable

TAG = "deepspeed"  # the folder of DeepSpeed's own checkpoint inside ours


def free_device_bytes(local_world_size: int) -> float:
    """Free memory of this process's device; on CPU, this process's share of the available RAM."""
    if torch.cuda.is_available():
        return float(torch.cuda.mem_get_info()[0])
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info.get("MemAvailable", info["MemTotal"]) / max(local_world_size, 1)


def unlink_shm_buffer(rank: int) -> None:
    """Remove this rank's name of DeepSpeed's shared-memory allreduce buffer, if it made one.

    With every rank on one host, DeepSpeed's CPU communication (ops/csrc/cpu/comm/shm.cpp) creates a 66 MB
    POSIX shared-memory segment per rank and never unlinks it: each run leaves its segments in /dev/shm,
    which is RAM, until the host runs out (21 GB here after a day of test runs). Once every rank has mapped
    its peers' segments the names are not needed; the memory goes when the last process unmaps it."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    with contextlib.suppress(FileNotFoundError):  # shm.cpp's name: prefix_uid_addr_port_rank
        os.remove(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}")


class EngineStepper:
    """backward() and step() through the engine, which divides by the accumulation steps, scales the loss,
    reduces the gradients at the accumulation boundary, clips and steps."""

    def __init__(self, engine):
        self.engine = engine

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()  # advances the engine's micro-step counter; no optimizer step

    def step(self) -> StepResult:
        skipped_before = self.engine.skipped_steps
        # ZeRO stage 0 in fp32 steps the module's own (already averaged) gradients and records no norm
        own = self.engine.zero_optimization_stage() == 0 and not self.engine.fp16_enabled()
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None] if own else []
        fallback = torch.nn.utils.get_total_norm(grads) if grads else None
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = norm if norm is not None else fallback
        norm = torch.tensor(float("nan") if norm is None else float(norm))
        return StepResult(norm, torch.tensor(self.engine.skipped_steps > skipped_before), self.loss_scale())

    def loss_scale(self) -> float:
        opt = self.engine.optimizer
        return float(getattr(opt, "cur_scale", getattr(opt, "loss_scale", 1.0)) or 1.0)


class ZeROWeights(Weights):
    """The fp32 weights the engine's optimizer steps: for a ZeRO-partitioned parameter the flat fragment this
    rank holds (none on some ranks), written as a ShardedTensor in the portable layout; whole tensors otherwise
    (stage 0). Read again each time (an offloaded ZeRO-3 partition comes back as a copy on the device)."""

    def __init__(self, module, engine_optimizer, backend):
        self._module, self._optimizer = module, engine_optimizer
        local, self._layout = local_weights(module, engine_optimizer)
        super().__init__(local, backend)

    def current(self):
        return list(local_weights(self._module, self._optimizer)[0].values())

    def checkpointable(self, tensors):
        return checkpointable(tensors, self._layout, self._backend.rank)

    def full(self, tensors):
        full = {}
        for name, t in self.checkpointable(tensors).items():  # the same order on every rank
            if not isinstance(t, ShardedTensor):  # a whole parameter (stage 0)
                full[name] = t.detach().float().cpu().clone()
                continue
            out = torch.empty(t.size()) if self.is_main else None
            t.gather(dst=0, out=out)  # collective over the default group
            full[name] = out
        return full if self.is_main else None


class DeepSpeedBackend(Backend):
    name = "deepspeed"

    def __init__(self, topo: Topology, opts: StepOptions = StepOptions(), options: DeepSpeedOptions | None = None):
        super().__init__(topo, opts)
        self._options = options or DeepSpeedOptions()
        self._zero_stage = None  # chosen by prepare()

    def setup(self) -> None:
        super().setup()
        check_precision(self._opts.precision, self.device.type == "cuda")  # before joining a process group
        export_launcher_env(self.topo)
        if not torch.distributed.is_initialized():
            deepspeed.init_distributed(
                dist_backend="nccl" if self.device.type == "cuda" else "gloo",
                verbose=False,
                timeout=datetime.timedelta(seconds=self._opts.dist_timeout),
            )
        self._collectives = ProcessGroup(self.world_size, self.device, self._opts.dist_timeout)
        self._unlink_shm_buffer()

    def _unlink_shm_buffer(self) -> None:
        self.barrier()  # every rank is past DeepSpeed's communication init: it has mapped its peers' buffers
        unlink_shm_buffer(self.rank)

    def teardown(self) -> None:
        destroy_process_group(self._collectives)

    def autocast(self):
        return contextlib.nullcontext()  # the engine applies bf16 / fp16 itself, from the config

    def prepare(self, model, make_optimizer, make_scheduler, workload: Workload = Workload()):
        o = self._options
        user_config = read_user_config(o.deepspeed_config)
        stage = self._choose_stage(model, workload.activation_bytes, user_config)
        config, conflicts = build_config(
            micro_batch=workload.micro_batch,
            accumulation_steps=self._opts.accumulation_steps,
            world_size=self.world_size,
            clip_grad_norm=self._opts.clip_grad_norm,
            precision=self._opts.precision,
            zero_stage=stage,
            offload_optimizer=o.offload_optimizer,
            offload_params=o.offload_params,
            initial_scale_power=self._opts.initial_scale_power,
            loss_scale_window=self._opts.loss_scale_window,
            hysteresis=o.hysteresis,
            min_loss_scale=o.min_loss_scale,
            on_gpu=self.device.type == "cuda",
            user_config=user_config,
        )
        # the JSON's stage wins over --zero_stage (with a warning): export, sampling and checkpoints follow it
        self._zero_stage = int(config["zero_optimization"]["stage"])
        if self.is_main:
            for line in conflicts:
                print(f"warning: {line}", flush=True)
        model = model.to(self.device)
        client_optimizer = make_optimizer(model)
        names = group_names(model, client_optimizer)  # before ZeRO flattens the groups
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, optimizer=client_optimizer, lr_scheduler=make_scheduler, config=config
        )
        self._unlink_shm_buffer()  # a process group made before setup() leaves DeepSpeed's init to here
        assert engine.zero_optimization_stage() == self._zero_stage, (engine.zero_optimization_stage(), config)
        self._stepper = EngineStepper(engine)
        self._checkpointer = DeepSpeedCheckpointer(self, engine, self._stepper, names, self._zero_stage)
        return engine, optimizer, scheduler

    def _choose_stage(self, model, activation_bytes: float, user_config: dict) -> int:
        """--zero_stage, the JSON's stage, or (auto) the lowest stage that fits on every rank, the same on all."""
        o = self._options
        stage = fixed_zero_stage(o, user_config)
        if stage is not None:
            if self.is_main and o.zero_stage == "auto":
                json_set = json_zero_stage(user_config) is not None
                why = "set in --deepspeed_config" if json_set else "the only stage that offloads parameters"
                print(f"--zero_stage auto: ZeRO-{stage}, {why} (no estimate)", flush=True)
            return stage
        n = sum(p.numel() for p in model.parameters() if p.requires_grad)
        mine = torch.tensor([free_device_bytes(self.topo.local_world_size)], dtype=torch.float64, device=self.device)
        free = self.all_gather(mine).tolist()  # every rank's: the stage must fit the smallest
        low = min(range(len(free)), key=free.__getitem__)
        offload_optimizer = offloads(o, user_config)[0]
        try:
            stage, estimates = choose_zero_stage(
                n, activation_bytes, free[low], self.world_size, self._opts.precision, offload_optimizer
            )
            answer = [stage]
        except ValueError as e:
            answer, estimates = [f"{e} (rank {low} has the least free memory)"], []
        # rank 0's answer is every rank's: no rank may run another stage, nor wait for a rank that raised
        torch.distributed.broadcast_object_list(answer, src=0, device=self.device)
        if isinstance(answer[0], str):
            raise ValueError(answer[0])
        if self.is_main:
            table = ", ".join(f"ZeRO-{s} {b / 2**20:.1f} MiB" for s, b in estimates)
            print(
                f"--zero_stage auto: ZeRO-{answer[0]} on every rank, the lowest that fits the smallest free memory "
                f"({free[low] / 2**30:.2f} GiB, rank {low}; per-device estimates: {table}"
                f"{', optimizer states offloaded' if offload_optimizer else ''})",
                flush=True,
            )
        return answer[0]

    def forward_watch(self, model):
        module = self._unwrap(model)
        if self._zero_stage != 3:
            return module, []
        # ZeRO-3 fetches each module's own parameters in its forward pre-hook (an all-gather: a wait for every rank)
        return module, [m for m in module.modules() if next(m.parameters(recurse=False), None) is not None]

    @contextlib.contextmanager
    def full_params(self, model):
        module = self._unwrap(model)
        with GatheredParameters(list(module.parameters()), modifier_rank=None, enabled=self._zero_stage == 3):
            yield module

    def weights(self, model) -> ZeROWeights:
        return ZeROWeights(self._unwrap(model), model.optimizer, self)

    def full_state_dict(self, model):
        module = self._unwrap(model)
        with self.full_params(model):
            sd = {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()} if self.is_main else None
        self.barrier()
        return sd


class DeepSpeedCheckpointer:
    """Two forms side by side, both written shard-wise by every rank. DeepSpeed's own (flat per-rank
    partitions) resumes exactly and fast at the same world size and ZeRO stage. The portable form
    (deepspeed_portable.py) is the layout the torch and Horovod backends write (tensors of full shape by
    parameter name through DCP, each rank writing the fragments it steps), which reshards to any backend,
    world size or stage."""

    def __init__(self, backend: DeepSpeedBackend, engine, stepper: EngineStepper, names: list, zero_stage: int):
        self.backend, self.engine, self.stepper = backend, engine, stepper
        self.group_names, self.zero_stage = names, zero_stage

    def _layout(self) -> dict:
        """What DeepSpeed's own checkpoint needs to match to be loadable."""
        return {"world_size": self.backend.world_size, "zero_stage": self.zero_stage}

    def save(self, directory: str, state: dict, extra: dict | None = None) -> None:
        b, engine = self.backend, self.engine
        engine.save_checkpoint(directory, tag=TAG, client_state={"state": state}, save_latest=False)
        with_optimizer = has_state(engine.optimizer)
        module = b._unwrap(engine)
        shards = sharded_state_dict(module, engine.optimizer, self.group_names, with_optimizer, b.rank)
        shards.update(extra or {})
        # collective over the default process group: each rank writes the fragments it holds to its own file
        dcp.save(shards, checkpoint_id=os.path.join(directory, "dcp"))
        if b.is_main:
            save_shared_file(
                directory,
                {
                    "scheduler": engine.lr_scheduler.state_dict(),
                    "scaler": self._scaler_state(),
                    "state": state,
                    "has_optimizer_state": with_optimizer,
                    "deepspeed": self._layout(),
                },
            )
        save_rank_file(directory, b.rank)

    def load(self, directory: str) -> dict:
        b = self.backend
        shared = load_shared_file(directory)
        if os.path.isdir(os.path.join(directory, TAG)) and shared.get("deepspeed") == self._layout():
            path, client = self.engine.load_checkpoint(directory, tag=TAG)
            if path is None:
                raise ValueError(f"{directory} holds no DeepSpeed checkpoint (tag {TAG})")
        else:
            self._load_portable(directory, shared)
        load_rank_file(directory, b.rank)
        b.barrier()
        return shared["state"]

    def _load_portable(self, directory: str, shared: dict) -> None:
        b, engine = self.backend, self.engine
        if not os.path.isdir(os.path.join(directory, "dcp")):
            raise ValueError(f"{directory} has no dcp/ folder: it holds no portable checkpoint")
        load_portable(
            b._unwrap(engine),
            engine.optimizer,
            self.group_names,
            os.path.join(directory, "dcp"),
            shared["has_optimizer_state"],
            self.zero_stage,
        )
        engine.lr_scheduler.load_state_dict(shared["scheduler"])
        if b._opts.precision == "fp16" and shared["scaler"]:
            engine.optimizer.loss_scaler.cur_scale = float(shared["scaler"]["scale"])
        if b.is_main:
            print(f"{directory}: loaded the portable (resharded) checkpoint on ZeRO-{self.zero_stage}", flush=True)

    def _scaler_state(self) -> dict:
        """DeepSpeed's dynamic loss scale as torch's GradScaler.state_dict() writes it (empty unless fp16)."""
        b = self.backend
        if b._opts.precision != "fp16":
            return {}
        return {
            "scale": self.stepper.loss_scale(),
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": b._opts.loss_scale_window,
            "_growth_tracker": 0,
        }


def read_weights(ckpt_dir: str) -> dict | None:
    """Full fp32 weights of a checkpoint holding only DeepSpeed's own ZeRO shards (through zero_to_fp32), or
    None when it holds none."""
    if not os.path.isdir(os.path.join(ckpt_dir, TAG)):
        return None
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return {k: v.float() for k, v in get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag=TAG).items()}
