"""The run plan (training/plan.py): worked out once, before the data and the models load, and read below."""

import dataclasses

import pytest
import torch

import train_vae
from dalle_pytorch.data.shapes import ShapesDataset
from dalle_pytorch.training import plan as plan_module
from dalle_pytorch.training.configs import TrainConfig
from dalle_pytorch.training.plan import RunPlan
from distributed import DeepSpeedOptions, HorovodOptions, Topology


def options(**deepspeed) -> dict:
    return {"deepspeed": DeepSpeedOptions(**deepspeed), "horovod": HorovodOptions()}


@pytest.mark.parametrize(
    "launcher,world,backend",
    [("none", 1, "single"), ("torchrun", 4, "ddp"), ("deepspeed", 2, "deepspeed"), ("ray", 2, "ddp")],
)
def test_auto_resolves_for_the_launcher_and_keeps_only_that_backends_options(launcher, world, backend):
    cfg = TrainConfig(batch_size=4, global_batch_size=16 * world)
    plan = RunPlan.make(cfg, options(), Topology(launcher, 0, world))
    assert plan.backend == backend and plan.accumulation == 4
    assert list(plan.backend_options) == ([backend] if backend == "deepspeed" else [])
    assert plan.global_batch(world) == 16 * world
    assert plan.step_options().accumulation_steps == 4
    assert plan.derived(world) == {
        "backend": backend, "launcher": launcher, "world_size": world, "accumulation_steps": 4,
        "global_batch_size": 16 * world,
    }  # fmt: skip


@pytest.mark.parametrize(
    "cfg,opts,topo,says",
    [
        (TrainConfig(batch_size=0), {}, Topology("none"), "--batch_size must be at least 1"),
        (TrainConfig(batch_size=4, global_batch_size=12), {}, Topology("torchrun", 0, 2),
         "--global_batch_size 12 is not a multiple of --batch_size x world size = 4 x 2"),
        (TrainConfig(), options(zero_stage=3), Topology("torchrun", 0, 2), "--zero_stage is a deepspeed flag"),
        (TrainConfig(distributed_backend="single"), {}, Topology("torchrun", 0, 2), "would train N unsynchronized"),
        (TrainConfig(distributed_backend="single", batch_size=4, global_batch_size=6), {}, Topology("torchrun", 0, 2),
         "--global_batch_size 6 is not a multiple"),  # the batch first, as the session said it before the plan
    ],
)  # fmt: skip
def test_a_bad_plan_is_one_line_naming_the_flag(cfg, opts, topo, says):
    with pytest.raises(ValueError, match=says):
        RunPlan.make(cfg, opts, topo)


def test_moved_to_another_place_in_the_job():
    """A Ray worker moves the driver's plan to its own rank and number of workers (and a restart resumes)."""
    plan = RunPlan.make(TrainConfig(batch_size=2, global_batch_size=8), {}, Topology("ray"))
    moved = plan.on(Topology("ray", 1, 2), resume="auto")
    assert (moved.accumulation, moved.topo.rank, moved.cfg.resume) == (2, 1, "auto")
    assert plan.cfg.resume == "" and plan.accumulation == 4  # the driver's plan is left as it was


@pytest.mark.parametrize("world", [1, 2, 3])
def test_steps_counted_on_the_data(world):
    data = ShapesDataset(100, 16)
    cfg = TrainConfig(batch_size=4, epochs=2, steps=0)
    plan = RunPlan.make(cfg, {}, Topology("torchrun" if world > 1 else "none", 0, world))
    assert plan.steps == 0
    assert plan.counted(data).steps == 2 * (100 // world // 4)  # whole batches of each rank's share, per epoch
    assert RunPlan.make(dataclasses.replace(cfg, steps=7)).counted(data).steps == 7


def test_a_run_validates_its_flags_and_reads_its_topology_once(tmp_path, monkeypatch):
    """train_vae.py end to end: the flags are validated, the launcher's environment read and the accumulation
    worked out once, by the plan, whatever reads them afterwards."""
    calls = {"validate": 0, "topology": 0, "accumulation": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(TrainConfig, "validate", counting("validate", TrainConfig.validate))
    monkeypatch.setattr(TrainConfig, "accumulation_steps", counting("accumulation", TrainConfig.accumulation_steps))
    monkeypatch.setattr(plan_module, "topology_from_env", counting("topology", plan_module.topology_from_env))
    torch.manual_seed(0)
    train_vae.main(
        ["--image_size", "16", "--num_layers", "2", "--num_tokens", "16", "--hidden_dim", "8", "--dataset_size", "16",
         "--batch_size", "4", "--steps", "2", "--num_workers", "0", "--sample_every", "0", "--save_every_n_steps", "0",
         "--no-tensorboard", "--quiet", "--output_dir", str(tmp_path)]
    )  # fmt: skip
    assert calls == {"validate": 1, "topology": 1, "accumulation": 1}
