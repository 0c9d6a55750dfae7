"""Which ZeRO stage a DeepSpeed run uses: --zero_stage, the stage in --deepspeed_config, or auto's estimate,
one stage for every rank and the one that export and checkpoints act on. The 2-rank checks fork + Gloo."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest
import torch
from multirank import on_ranks
from torch import nn

from distributed import DeepSpeedOptions, StepOptions, Workload, make_backend, topology_from_env
from distributed.checkpoint_io import load_shared_file
from distributed.deepspeed_config import build_config, choose_zero_stage, fixed_zero_stage, read_user_config
from distributed.deepspeed_config import zero_memory_bytes as need

ACT = 1000.0  # activation bytes of one micro-batch, as the task would estimate them


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


PARAMS = sum(p.numel() for p in model().parameters())


def budget_for(stage: int) -> float:
    """Free bytes in which `stage` (fp32, 2 ranks) is the lowest that fits."""
    return (need(PARAMS, stage, 2, "fp32") + ACT) / 0.8 * 1.01


def _prepare(flag: str, config_path: str = "", free=None):
    """This rank's backend, engine and what rank 0 printed. `free`: the free device memory this rank reports,
    or an exception to raise if asked (patched in this forked process only)."""
    from distributed import deepspeed_backend

    def free_device_bytes(local_world_size):
        if isinstance(free, Exception):
            raise free
        return free

    deepspeed_backend.free_device_bytes = free_device_bytes
    options = DeepSpeedOptions(zero_stage=flag, deepspeed_config=config_path)
    backend = make_backend("deepspeed", topology_from_env(), StepOptions(clip_grad_norm=1.0), deepspeed=options)
    backend.setup()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        engine, _, _ = backend.prepare(
            model(),
            lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
            lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0),
            Workload(micro_batch=4, activation_bytes=ACT),
        )
    return backend, engine, out.getvalue()


def _auto_on_rank(rank, frees):
    backend, engine, printed = _prepare("auto", free=frees[rank])
    return backend._zero_stage, int(engine.zero_optimization_stage()), printed


def test_zero_auto_chooses_one_stage_for_the_smallest_memory():
    """Rank 0 alone would choose ZeRO-0; rank 1 has room for ZeRO-2 only: both run ZeRO-2."""
    frees = [budget_for(0), budget_for(2)]
    assert [choose_zero_stage(PARAMS, ACT, f, 2, "fp32")[0] for f in frees] == [0, 2]
    (stage0, engine0, printed), (stage1, engine1, _) = on_ranks(2, _auto_on_rank, frees)
    assert (stage0, engine0, stage1, engine1) == (2, 2, 2, 2)
    assert "ZeRO-2 on every rank" in printed and "rank 1;" in printed and "ZeRO-0 " in printed


def _no_fit_on_rank(rank, frees):
    with pytest.raises(ValueError) as e:
        _prepare("auto", free=frees[rank])
    return str(e.value)


def test_zero_auto_that_fits_nowhere_stops_every_rank():
    """Only rank 1 lacks memory; rank 0 decides and every rank raises, none waits for another."""
    messages = on_ranks(2, _no_fit_on_rank, [budget_for(0), budget_for(3) / 4])
    assert messages[0] == messages[1] and "no ZeRO stage fits" in messages[0] and "rank 1" in messages[0]


def _json_stage_on_rank(rank, flag, config_path, ckpt):
    backend, engine, printed = _prepare(flag, config_path, free=AssertionError("no estimate with a JSON stage"))
    x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)), torch.ones(4, 1)

    def train(steps):
        for _ in range(steps):
            backend.backward(nn.functional.mse_loss(engine(x), y))
            backend.step()

    train(3)
    exported = backend.full_state_dict(engine)  # gathered: ZeRO-3 holds a slice of each weight per rank
    backend.save_checkpoint(ckpt, {"step": 3})
    train(1)
    state = backend.load_checkpoint(ckpt)
    restored = backend.full_state_dict(engine)
    return backend._zero_stage, int(engine.zero_optimization_stage()), printed, exported, restored, state


@pytest.mark.parametrize("flag", ["auto", "1"])
def test_zero_stage_in_the_json_is_the_stage_everywhere(flag, tmp_path):
    """{"zero_optimization": {"stage": 3}}: the backend runs, exports and checkpoints as ZeRO-3, with the flag at
    auto (no estimate) or at another stage (a warning; the JSON wins, as every key of it does)."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    ranks = on_ranks(2, _json_stage_on_rank, flag, str(config), ckpt)
    assert [r[:2] for r in ranks] == [(3, 3), (3, 3)]
    _, _, printed, exported, restored, state = ranks[0]
    if flag == "auto":
        assert "--zero_stage auto: ZeRO-3, set in --deepspeed_config (no estimate)" in printed
    else:
        assert "zero_optimization.stage: --deepspeed_config says 3, the flags say 1" in printed
    full = model().state_dict()
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in full.items()}
    assert not all(torch.equal(exported[k], full[k]) for k in full)  # trained
    assert all(torch.equal(restored[k], exported[k]) for k in full) and state == {"step": 3}
    assert load_shared_file(ckpt)["deepspeed"] == {"world_size": 2, "zero_stage": 3}
    assert ranks[1][3] is None  # the export is rank 0's


def test_which_stage_is_fixed_and_what_is_refused(tmp_path):
    opts = DeepSpeedOptions
    assert fixed_zero_stage(opts(zero_stage="1"), {"zero_optimization": {"stage": 3}}) == 1  # build_config: JSON wins
    assert fixed_zero_stage(opts(), {"zero_optimization": {"stage": 2}}) == 2
    assert fixed_zero_stage(opts(offload_params=True), {}) == 3  # DeepSpeed offloads parameters in ZeRO-3 only
    assert fixed_zero_stage(opts(), {"zero_optimization": {"offload_param": {"device": "cpu"}}}) == 3
    assert fixed_zero_stage(opts(), {}) is None  # auto estimates
    with pytest.raises(ValueError, match="stage must be 0-3 .*'auto'.*drop it"):
        fixed_zero_stage(opts(), {"zero_optimization": {"stage": "auto"}})

    # an offloaded optimizer costs host memory, not device memory, and needs ZeRO-1 or above
    assert need(PARAMS, 0, 2, "bf16", offload_optimizer=True) == 4 * PARAMS
    assert choose_zero_stage(PARAMS, ACT, 1e12, 2, "bf16", offload_optimizer=True)[0] == 1

    base = dict(micro_batch=1, accumulation_steps=1, world_size=2, clip_grad_norm=1.0, precision="fp32", on_gpu=False)
    with pytest.raises(ValueError, match="--offload_params needs ZeRO-3: set --zero_stage to 3 \\(it is 2\\)"):
        build_config(**base, zero_stage=2, offload_params=True)
    with pytest.raises(ValueError, match="set zero_optimization.stage in --deepspeed_config to 3 \\(it is 2\\)"):
        build_config(**base, zero_stage=3, offload_params=True, user_config={"zero_optimization": {"stage": 2}})
    with pytest.raises(ValueError, match="--offload_optimizer needs ZeRO-1, 2 or 3: set --zero_stage"):
        build_config(**base, zero_stage=0, offload_optimizer=True)
    cfg, conflicts = build_config(**base, zero_stage=1, user_config={"zero_optimization": {"stage": 3}})
    assert cfg["zero_optimization"]["stage"] == 3  # the JSON's, as every key of it
    assert conflicts == ["zero_optimization.stage: --deepspeed_config says 3, the flags say 1; using the config"]

    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ValueError, match="expected an object"):
        read_user_config(str(tmp_path / "list.json"))
