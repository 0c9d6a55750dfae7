"""DeepSpeed's training state in the layout every other backend reads, so checkpoints cross backends.

DeepSpeed's own checkpoint holds flat per-rank partitions and loads only at the same world size and ZeRO
stage. Beside it the DeepSpeed backend writes the layout of torch's `get_model_state_dict` /
`get_optimizer_state_dict` (full fp32 weights, Adam moments and step per parameter name, param groups
listing names), which torch.distributed.checkpoint reshards on load. The tensors are gathered from and
scattered to the partitions with DeepSpeed's public tensor-fragment API (`safe_get_full_fp32_param`, ...).
So a DeepSpeed checkpoint resumes under DDP, FSDP, Horovod or one process at any world size, at another
ZeRO stage, and their checkpoints resume under DeepSpeed.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from deepspeed.runtime.zero.partition_parameters import GatheredParameters
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter state besides its step


def base_optimizer(engine_optimizer) -> torch.optim.Optimizer:
    """The torch optimizer that steps: ZeRO and DeepSpeed's bf16 optimizer wrap it, stage 0 in fp32 does not."""
    return getattr(engine_optimizer, "optimizer", engine_optimizer)


def group_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Parameter names per param group, read from the client optimizer before DeepSpeed flattens it."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def _masters(engine_optimizer) -> dict[int, tuple[torch.Tensor, int]]:
    """id(parameter) -> (the fp32 tensor the base optimizer steps for it, its offset there), for DeepSpeed's
    unpartitioned half-precision optimizers (ZeRO stage 0 with fp16 or bf16): FP16_Optimizer steps one flat
    fp32 copy per group, FP16_UnfusedOptimizer one fp32 copy per parameter. Other parameters map to none."""
    out = {}
    groups = getattr(engine_optimizer, "fp16_groups", None)
    if groups is not None and hasattr(engine_optimizer, "fp32_groups_flat"):
        for params, flat in zip(groups, engine_optimizer.fp32_groups_flat):
            offset = 0
            for p in params:
                out[id(p)] = (flat, offset)
                offset += p.numel()
    elif groups is not None and hasattr(engine_optimizer, "fp32_groups"):
        for params, copies in zip(groups, engine_optimizer.fp32_groups):
            out.update({id(p): (c, 0) for p, c in zip(params, copies)})
    return out


def _view(t: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    return t.detach().view(-1).narrow(0, offset, like.numel()).view_as(like)


def _partitioned(p) -> bool:
    return hasattr(p, "ds_id") or hasattr(p, "_hp_mapping")


def _adam_step(base) -> torch.Tensor:
    """DeepSpeed steps every flat partition together, so one step count holds for every parameter."""
    return next(s["step"] for s in base.state.values() if "step" in s)


def has_state(engine_optimizer) -> bool:
    """Whether Adam's moments exist yet (ZeRO-3 leaves empty entries in the state before the first step)."""
    return any(MOMENTS[0] in s for s in base_optimizer(engine_optimizer).state.values())


def _link_moments(engine_optimizer) -> None:
    """Point each parameter's fragment at its slice of the flat Adam moments (ZeRO-1/2, bf16 optimizer).

    DeepSpeed 0.19 links them once, right after the first group's first step, when the later groups have no
    state yet, so with two param groups (decay / no decay) the second group's moments stay unreachable
    ("exp_avg not found in optimizer state fragment"). Relinking once every group has state mends that."""
    if hasattr(engine_optimizer, "_hp_optimizer_states_linked"):
        engine_optimizer._hp_optimizer_states_linked = False
        engine_optimizer._lazy_init_hp_params_optimizer_state()


def gather(
    module, engine_optimizer, names: list[list[str]], with_optimizer: bool, keep: bool = True
) -> tuple[dict, dict | None]:
    """Collective: (model state dict, optimizer state dict) with full fp32 CPU tensors. Ranks with
    keep=False take part in the gathers but drop the results, so only the writer holds a full copy."""
    base = base_optimizer(engine_optimizer)
    if with_optimizer:
        _link_moments(engine_optimizer)
    params = dict(module.named_parameters())
    masters = _masters(engine_optimizer)
    model_sd = {k: v.detach().cpu().clone() for k, v in module.state_dict().items() if k not in params}  # buffers
    state = {}
    for name, p in params.items():
        if _partitioned(p):
            weight = safe_get_full_fp32_param(p)
            moments = {k: safe_get_full_optimizer_state(p, k) for k in MOMENTS} if with_optimizer else {}
        else:  # the fp32 copy the optimizer steps, or the parameter itself in fp32 without ZeRO
            src, offset = masters.get(id(p), (p, 0))
            weight = _view(src, offset, p).float()
            moments = {k: _view(base.state[src][k], offset, p) for k in MOMENTS} if with_optimizer else {}
        if not keep:
            continue
        model_sd[name] = weight.cpu().clone()
        if with_optimizer:
            moments = {k: v.cpu().clone() for k, v in moments.items()}
            state[name] = {"step": _adam_step(base).detach().cpu().clone(), **moments}
    if not with_optimizer:
        return model_sd, None
    return model_sd, {"state": state, "param_groups": _named_groups(base, names)}


def _named_groups(base, names: list[list[str]]) -> list[dict]:
    """The optimizer's param groups as get_optimizer_state_dict writes them: hyperparameters and names."""
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": n} for g, n in zip(base.param_groups, names)]


def init_state(engine_optimizer) -> None:
    """Create the optimizer's state (it is made lazily at the first step) so that it can be overwritten:
    one step on zero gradients at learning rate 0, which moves no weight (torch's DCP does the same in
    torch.distributed.checkpoint.state_dict._init_optim_state). Call _link_moments after it (ZeRO-1/2)."""
    if has_state(engine_optimizer):
        return
    base = base_optimizer(engine_optimizer)
    saved = [(g["lr"], g["params"]) for g in base.param_groups]
    flat = getattr(engine_optimizer, "fp32_partitioned_groups_flat", None)
    if flat is not None:  # ZeRO-3 hands each group its flat fp32 partitions only while it steps
        for g in base.param_groups:
            g["params"] = []
        for sub_group, p in enumerate(flat):
            base.param_groups[engine_optimizer.sub_group_to_group_id[sub_group]]["params"].append(p)
    grads = {}  # offloaded optimizers keep persistent gradient buffers on these tensors: put them back
    for g in base.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            grads[id(p)] = p.grad
            p.grad = torch.zeros_like(p)
    base.step()
    for g, (lr, params) in zip(base.param_groups, saved):
        for p in g["params"]:
            p.grad = grads[id(p)]
        g["lr"], g["params"] = lr, params


def load(module, engine_optimizer, names: list[list[str]], checkpoint_id: str, with_optimizer: bool, zero_stage: int):
    """Collective: read a portable checkpoint (DCP, any writer) into the engine, a few parameters at a time:
    each rank reads the full tensors of a chunk, keeps its partitions, and drops them before the next chunk,
    so no rank ever holds more than a chunk beyond its own partition."""
    base = base_optimizer(engine_optimizer)
    if with_optimizer:
        init_state(engine_optimizer)
        _link_moments(engine_optimizer)
    params = dict(module.named_parameters())
    masters = _masters(engine_optimizer)
    step = None
    order = list(params)
    for i in range(0, len(order), _CHUNK):
        chunk = {n: params[n] for n in order[i : i + _CHUNK]}
        shapes = {n: tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape) for n, p in chunk.items()}
        sd = {"model": {n: torch.empty(shape) for n, shape in shapes.items()}}
        if with_optimizer:
            empty = {n: {"step": torch.zeros(()), **{k: torch.empty(s) for k in MOMENTS}} for n, s in shapes.items()}
            sd["optimizer"] = {"state": empty}
        dcp.load(sd, checkpoint_id=checkpoint_id, no_dist=True)
        for name, p in chunk.items():
            _set_param(p, sd["model"][name], masters, zero_stage)
            if with_optimizer:
                saved = sd["optimizer"]["state"][name]
                _set_moments(p, saved, base, masters)
                step = saved["step"]
    persistent = set(module.state_dict())
    buffers = {n: b for n, b in module.named_buffers() if n in persistent}
    if buffers:
        sd = {"model": {n: b.detach().cpu().clone() for n, b in buffers.items()}}
        dcp.load(sd, checkpoint_id=checkpoint_id, no_dist=True)
        for n, b in buffers.items():
            b.copy_(sd["model"][n])
    if not with_optimizer:
        return
    for s in base.state.values():
        if "step" in s:
            s["step"] = step.clone().to(s["step"].device) if torch.is_tensor(s["step"]) else float(step)
    sd = {"optimizer": {"param_groups": _named_groups(base, names)}}
    dcp.load(sd, checkpoint_id=checkpoint_id, no_dist=True)
    for g, saved in zip(base.param_groups, sd["optimizer"]["param_groups"]):
        g.update({k: v for k, v in saved.items() if k != "params"})


_CHUNK = 16  # parameters read per DCP call when loading


def _set_param(p, value: torch.Tensor, masters: dict, zero_stage: int) -> None:
    """The model's own (possibly bf16, possibly partitioned) parameter and the fp32 copy the optimizer steps."""
    with GatheredParameters([p], modifier_rank=0, enabled=zero_stage == 3):
        p.data.copy_(value.to(p.device, p.dtype))
    src, offset = masters.get(id(p), (p, 0))
    if _partitioned(p):
        safe_set_full_fp32_param(p, value.to(p.device))
    elif src is not p:
        _view(src, offset, p).copy_(value)


def _set_moments(p, saved: dict, base, masters: dict) -> None:
    src, offset = masters.get(id(p), (p, 0))
    for k in MOMENTS:
        if _partitioned(p):
            safe_set_full_optimizer_state(p, saved[k].to(p.device), k)
        else:
            _view(base.state[src][k], offset, p).copy_(saved[k])
