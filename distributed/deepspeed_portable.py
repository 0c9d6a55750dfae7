"""DeepSpeed's training state in the layout every other backend reads, so checkpoints cross backends.

DeepSpeed's own checkpoint holds flat per-rank partitions and loads only at the same world size and ZeRO
stage. Beside it the DeepSpeed backend writes the layout of torch's `get_model_state_dict` /
`get_optimizer_state_dict` (fp32 weights, Adam moments and step per parameter name in full shapes, param
groups listing names), which torch.distributed.checkpoint (DCP) reshards on load. Every rank writes only the
fragments it steps: a ZeRO partition of a parameter is a contiguous range of the flat tensor, written as the
rectangular blocks that make up that range (a ShardedTensor), so no host ever holds more than its own share.
Loading reads a few full parameters at a time and scatters them into the partitions with DeepSpeed's public
tensor-fragment API (`safe_set_full_fp32_param`, ...). So a DeepSpeed checkpoint resumes under DDP, FSDP,
Horovod or one process at any world size, at another ZeRO stage, and their checkpoints resume under DeepSpeed.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
from deepspeed import comm as ds_comm
from deepspeed.runtime.zero.partition_parameters import GatheredParameters
from deepspeed.utils import (
    safe_get_local_fp32_param,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata, init_from_local_shards

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


def _full_shape(p) -> tuple[int, ...]:
    """A parameter's own shape (ZeRO-3 leaves an empty tensor in its place and keeps the shape in ds_shape)."""
    return tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)


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


def flat_blocks(start: int, stop: int, shape) -> list[tuple[int, list[int], list[int]]]:
    """The elements [start, stop) of a row-major tensor of `shape` as rectangular blocks, in order: (flat
    index of the block's first element, its offsets, its sizes). Each block is a contiguous run of the flat
    range, so it is a view of a flat fragment; there are at most 2 * len(shape) - 1 of them."""
    if start >= stop:
        return []
    if len(shape) == 0:
        return [(start, [], [])]
    inner = math.prod(shape[1:])
    (r0, a), (r1, b) = divmod(start, inner), divmod(stop, inner)

    def within_row(row: int, lo: int, hi: int) -> list:
        return [(row * inner + f, [row, *o], [1, *s]) for f, o, s in flat_blocks(lo, hi, shape[1:])]

    if r0 == r1:
        return within_row(r0, a, b)
    out = []
    if a:  # the end of the first, partial row
        out += within_row(r0, a, inner)
        r0 += 1
    if r1 > r0:  # whole rows
        out.append((r0 * inner, [r0, *[0] * (len(shape) - 1)], [r1 - r0, *shape[1:]]))
    if b:  # the start of the last, partial row
        out += within_row(r1, 0, b)
    return out


def _sharded(shape, start: int, fragment: torch.Tensor | None, rank: int) -> ShardedTensor:
    """Collective: the tensor of full `shape` of which this rank holds the flat elements [start, start +
    fragment.numel()) (none where fragment is None), as a ShardedTensor of rectangular blocks, which DCP
    writes shard by shard and reads back into any other sharding or a plain tensor."""
    shards = []
    if fragment is not None:
        placement = f"rank:{rank}/{fragment.device}"
        for first, offsets, sizes in flat_blocks(start, start + fragment.numel(), shape):
            block = fragment.narrow(0, first - start, math.prod(sizes)).view(sizes)
            shards.append(Shard(block, ShardMetadata(offsets, sizes, placement)))
    return init_from_local_shards(shards, *shape)


def _local_fragment(p) -> tuple[int, torch.Tensor, Callable[[str], torch.Tensor]] | None:
    """(first flat index, fp32 weights, Adam moment by name) of the part of a partitioned parameter that
    this rank steps, as flat views of DeepSpeed's own partitions; None where this rank steps none of it."""
    if hasattr(p, "ds_id"):
        # ZeRO-3 (public local API): rank r of the parameter's partition group holds the elements
        # [r * n, (r + 1) * n) of the flat parameter, the last partition padded beyond ds_numel
        # (deepspeed/runtime/zero/partition_parameters.py, _partition_param)
        local = safe_get_local_fp32_param(p).detach().view(-1)
        start = local.numel() * ds_comm.get_rank(group=getattr(p, "ds_process_group", None))
        numel = min(local.numel(), p.ds_numel - start)
        if numel <= 0:
            return None

        def moment(key):
            return safe_get_local_optimizer_state(p, key).detach().view(-1).narrow(0, 0, numel)

        return start, local.narrow(0, 0, numel), moment
    # ZeRO-1/2 and the bf16 optimizer: DeepSpeed has no public local API for these (deepspeed.utils'
    # safe_get_local_* assert ZeRO-3), so this reads the fragment mapping its own safe_get_full_fp32_param
    # and universal checkpoint read (deepspeed/utils/tensor_fragment.py, checkpoint/universal_checkpoint.py):
    # lp_fragment_address locates the fragment in the flat parameter, get_hp_fragment() gives its fp32
    # weights or an optimizer state. It is None on ranks whose partition holds none of the parameter.
    mapping = p._hp_mapping
    if mapping is None:
        return None
    address = mapping.lp_fragment_address
    return address.start, mapping.get_hp_fragment().detach(), lambda key: mapping.get_hp_fragment(key).detach()


def sharded_state_dict(module, engine_optimizer, names: list[list[str]], with_optimizer: bool, rank: int) -> dict:
    """Collective: the portable layout ({"model": ..., "optimizer": ...} by parameter name, full shapes)
    holding only what this rank already has, for a collective dcp.save in which every rank writes its own
    share. A partitioned parameter, its fp32 weights and moments, is a ShardedTensor of the fragments each
    rank steps (nothing is gathered or copied). Without ZeRO partitioning (stage 0) and for the buffers,
    step and param groups every rank offers the same plain tensors, and DCP writes each once, spreading
    them over the ranks (torch.distributed.checkpoint._dedup_save_plans)."""
    base = base_optimizer(engine_optimizer)
    if with_optimizer:
        _link_moments(engine_optimizer)
    params = dict(module.named_parameters())
    masters = _masters(engine_optimizer)
    model_sd = {k: v.detach() for k, v in module.state_dict().items() if k not in params}  # buffers
    keys = MOMENTS if with_optimizer else ()
    state = {}
    for name, p in params.items():
        if _partitioned(p):
            shape = _full_shape(p)
            start, weight, moment = _local_fragment(p) or (0, None, lambda key: None)
            model_sd[name] = _sharded(shape, start, weight, rank)
            moments = {k: _sharded(shape, start, moment(k), rank) for k in keys}
        else:  # the fp32 copy the optimizer steps, or the parameter itself in fp32 without ZeRO
            src, offset = masters.get(id(p), (p, 0))
            model_sd[name] = _view(src, offset, p).float()
            moments = {k: _view(base.state[src][k], offset, p) for k in keys}
        if with_optimizer:
            state[name] = {"step": torch.as_tensor(_adam_step(base)).detach(), **moments}
    if not with_optimizer:
        return {"model": model_sd}
    return {"model": model_sd, "optimizer": {"state": state, "param_groups": _named_groups(base, names)}}


def local_weights(module, engine_optimizer) -> tuple[dict, dict]:
    """(name -> the fp32 weights this rank steps, as live flat fragments or whole tensors; name -> (full shape,
    first flat index) for partitioned parameters, None for whole ones). A partitioned parameter of which this
    rank steps nothing has a layout entry but no weights."""
    masters = _masters(engine_optimizer)
    local, layout = {}, {}
    for name, p in module.named_parameters():
        if _partitioned(p):
            found = _local_fragment(p)
            layout[name] = (_full_shape(p), found[0] if found else 0)
            if found:
                local[name] = found[1]
        else:
            src, offset = masters.get(id(p), (p, 0))
            layout[name], local[name] = None, _view(src, offset, p)
    return local, layout


def checkpointable(tensors: dict, layout: dict, rank: int) -> dict:
    """Collective: tensors in local_weights' layout as DCP saves and loads them in place (ShardedTensors of
    each rank's fragments, plain tensors for whole parameters), by name in full shapes."""
    return {
        name: tensors[name] if where is None else _sharded(where[0], where[1], tensors.get(name), rank)
        for name, where in layout.items()
    }


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
        shapes = {n: _full_shape(p) for n, p in chunk.items()}
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
