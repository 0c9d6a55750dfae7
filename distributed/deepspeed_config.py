"""Our flags -> a DeepSpeed config, and the ZeRO stage choice. Pure functions: testable without DeepSpeed.

Memory per device follows the ZeRO paper (Rajbhandari et al. 2020, section 5): with mixed precision
and Adam, Psi parameters cost 2 Psi (fp16/bf16 weights) + 2 Psi (gradients) + 12 Psi (fp32 master weights,
momentum, variance) bytes; ZeRO-1 partitions the optimizer states, ZeRO-2 also the gradients, ZeRO-3 also
the weights. In fp32 the weights and gradients are 4 Psi each and Adam adds 8 Psi. --offload_optimizer moves
the optimizer states (with the fp32 master weights: the 12 Psi) to host memory, ZeRO-Offload (Ren et al. 2021).
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass

from dalle_pytorch.config import flag


@contextmanager
def hidden_module(name: str):
    """`import name` fails inside (None in sys.modules), unless it was imported before; as it was after."""
    hide = name not in sys.modules
    if hide:
        sys.modules[name] = None
    try:
        yield
    finally:
        if hide and name in sys.modules and sys.modules[name] is None:
            del sys.modules[name]


def check_precision(precision: str, on_gpu: bool) -> None:
    if precision == "fp16" and not on_gpu:
        raise ValueError(
            "DeepSpeed fp16 needs a GPU (its loss scaler is GPU-only): use --precision bf16 or fp32 on CPU"
        )


@dataclass
class DeepSpeedOptions:
    """The DeepSpeed backend's flags (the loss-scale start and window are shared by every backend's fp16)."""

    zero_stage: str = flag(
        "auto",
        "DeepSpeed ZeRO stage; auto: the --deepspeed_config's stage, else 3 with --offload_params, else the lowest "
        "that fits in the smallest free device memory of all ranks",
        choices=("auto", "0", "1", "2", "3"),
    )
    offload_optimizer: bool = flag(False, "DeepSpeed ZeRO-1/2/3: keep optimizer states in CPU memory")
    offload_params: bool = flag(False, "DeepSpeed ZeRO-3: keep parameters in CPU memory")
    deepspeed_config: str = flag("", "a DeepSpeed JSON config; our flags fill only what it leaves out")
    hysteresis: int = flag(2, "fp16 (DeepSpeed): overflows tolerated before the loss scale drops")
    min_loss_scale: float = flag(1.0, "fp16 (DeepSpeed): the loss scale never drops below this")


def zero_memory_bytes(
    num_params: int, stage: int, world_size: int, precision: str, offload_optimizer: bool = False
) -> float:
    """Model-state bytes per device (parameters, gradients, optimizer states) for a ZeRO stage."""
    if precision == "fp32":
        w, g, opt = 4.0, 4.0, 8.0
    else:
        w, g, opt = 2.0, 2.0, 12.0
    if offload_optimizer:
        opt = 0.0  # in host memory
    n = max(world_size, 1)
    if stage == 0:
        per = w + g + opt
    elif stage == 1:
        per = w + g + opt / n
    elif stage == 2:
        per = w + (g + opt) / n
    elif stage == 3:
        per = (w + g + opt) / n
    else:
        raise ValueError(f"ZeRO stage must be 0-3 (got {stage})")
    return per * num_params


def choose_zero_stage(
    num_params: int,
    activation_bytes: float,
    free_bytes: float,
    world_size: int,
    precision: str,
    offload_optimizer: bool = False,
    margin: float = 0.2,
) -> tuple[int, list[tuple[int, float]]]:
    """The lowest stage whose estimate fits in (1 - margin) x free_bytes, and every stage's estimate.

    Lower stages communicate less, so the lowest one that fits is the fastest. Raises when none fits.
    Offloading the optimizer needs ZeRO-1 or above (DeepSpeed ignores it at stage 0).
    """
    stages = range(1, 4) if offload_optimizer else range(4)
    estimates = [
        (s, zero_memory_bytes(num_params, s, world_size, precision, offload_optimizer) + activation_bytes)
        for s in stages
    ]
    budget = free_bytes * (1 - margin)
    for stage, need in estimates:
        if need <= budget:
            return stage, estimates
    raise ValueError(
        f"no ZeRO stage fits: ZeRO-3 needs {estimates[-1][1] / 2**30:.2f} GiB per device, {budget / 2**30:.2f} GiB "
        "available: lower --batch_size, add devices, or use --offload_optimizer / --offload_params"
    )


def json_zero_stage(user_config: dict) -> int | None:
    """zero_optimization.stage in the user's JSON, or None where it has none."""
    stage = user_config.get("zero_optimization", {}).get("stage")
    if stage is not None and str(stage) not in ("0", "1", "2", "3"):  # "auto" is Hugging Face's, not DeepSpeed's
        raise ValueError(f"--deepspeed_config: zero_optimization.stage must be 0-3 (got {stage!r}): for auto, drop it")
    return None if stage is None else int(stage)


def offloads(options: DeepSpeedOptions, user_config: dict) -> tuple[bool, bool]:
    """(optimizer states, parameters): whether each goes to host memory, by our flags or the user's JSON."""
    zero = user_config.get("zero_optimization", {})

    def on(key: str) -> bool:  # DeepSpeed's default device is "none": no offload
        return (zero.get(key) or {}).get("device", "none") != "none"

    return options.offload_optimizer or on("offload_optimizer"), options.offload_params or on("offload_param")


def fixed_zero_stage(options: DeepSpeedOptions, user_config: dict) -> int | None:
    """The ZeRO stage the flags or --deepspeed_config fix, or None when --zero_stage auto must estimate one.

    An explicit --zero_stage that the JSON contradicts is returned as given: build_config warns and the JSON's
    stage wins, as every key of the JSON does."""
    if options.zero_stage != "auto":
        return int(options.zero_stage)
    stage = json_zero_stage(user_config)
    if stage is not None:
        return stage
    if offloads(options, user_config)[1]:
        return 3  # DeepSpeed offloads parameters in ZeRO-3 only
    return None


def build_config(
    *,
    micro_batch: int,
    accumulation_steps: int,
    world_size: int,
    clip_grad_norm: float,
    precision: str,
    zero_stage: int,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    initial_scale_power: int = 16,
    loss_scale_window: int = 1000,
    hysteresis: int = 2,
    min_loss_scale: float = 1.0,
    on_gpu: bool = True,
    user_config: dict | None = None,
) -> tuple[dict, list[str]]:
    """The DeepSpeed config for our flags, merged under the user's `--deepspeed_config` JSON.

    The user's values win; our flags fill only what the user left out. Returns (config, conflicts),
    one line per key where the user's JSON disagrees with a flag.
    """
    check_precision(precision, on_gpu)
    ours: dict = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation_steps,
        "train_batch_size": micro_batch * accumulation_steps * world_size,
        # DeepSpeed >= 0.19.3 clips to 1.0 when this is absent: always say what we mean (0 = off)
        "gradient_clipping": float(clip_grad_norm),
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,  # our torch AdamW, built by the loop
        "zero_force_ds_cpu_optimizer": False,  # offload steps our AdamW on the CPU: no JIT-built CPUAdam needed
        "steps_per_print": 10**9,  # the loop logs
        "wall_clock_breakdown": False,
    }
    if precision == "bf16":
        if on_gpu:
            ours["bf16"] = {"enabled": True}
        else:  # bf16 weights are slow on CPU; autocast keeps fp32 weights like the other backends
            ours["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    elif precision == "fp16":
        ours["fp16"] = {
            "enabled": True,
            "loss_scale": 0,  # dynamic
            "initial_scale_power": initial_scale_power,
            "loss_scale_window": loss_scale_window,
            "hysteresis": hysteresis,
            "min_loss_scale": min_loss_scale,
        }
    # the user's JSON wins (_merge), so its stage is the one DeepSpeed runs and the one the offloads need
    stage = json_zero_stage(user_config or {})
    where = "--zero_stage" if stage is None else "zero_optimization.stage in --deepspeed_config"
    stage = zero_stage if stage is None else stage
    zero = ours["zero_optimization"]
    if offload_optimizer:
        if stage == 0:  # DeepSpeed would ignore it: stage 0 has no ZeRO optimizer to offload
            raise ValueError(f"--offload_optimizer needs ZeRO-1, 2 or 3: set {where} to one of them (it is 0)")
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if offload_params:
        if stage != 3:  # DeepSpeed would ignore it: only ZeRO-3 partitions (and so can offload) parameters
            raise ValueError(f"--offload_params needs ZeRO-3: set {where} to 3 (it is {stage})")
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    if zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    conflicts: list[str] = []
    merged = _merge(user_config or {}, ours, "", conflicts)
    return merged, conflicts


def _merge(user: dict, ours: dict, prefix: str, conflicts: list[str]) -> dict:
    out = dict(user)
    for k, v in ours.items():
        if k not in user:
            out[k] = v
        elif isinstance(v, dict) and isinstance(user[k], dict):
            out[k] = _merge(user[k], v, f"{prefix}{k}.", conflicts)
        elif user[k] != v and k != "train_batch_size" or k == "train_batch_size" and user[k] not in (v, "auto"):
            conflicts.append(f"{prefix}{k}: --deepspeed_config says {user[k]!r}, the flags say {v!r}; using the config")
    return out


def read_user_config(path: str) -> dict:
    if not path:
        return {}
    if not os.path.exists(path):
        raise FileNotFoundError(f"--deepspeed_config {path} does not exist")
    with open(path) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"--deepspeed_config {path} is not valid JSON: {e}") from None
    if not isinstance(config, dict) or not isinstance(config.get("zero_optimization", {}), dict):
        raise ValueError(f'--deepspeed_config {path}: expected an object like {{"zero_optimization": {{"stage": 2}}}}')
    return config
