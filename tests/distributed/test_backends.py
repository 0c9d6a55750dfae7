"""Backend semantics in one process: fp16 loss scaling, accumulation arithmetic, topology and backend choice."""

import pytest
import torch

from dalle_pytorch.training.configs import TrainConfig
from distributed import HorovodOptions, StepOptions, Topology, make_backend
from distributed.deepspeed_config import build_config, choose_zero_stage, zero_memory_bytes
from distributed.topology import resolve_backend, topology_from_env


def _prepared(precision="fp16"):
    backend = make_backend("single", Topology("none"), StepOptions(precision=precision, clip_grad_norm=1.0))
    backend.setup()
    model = torch.nn.Linear(4, 1)
    model, opt, sched = backend.prepare(
        model,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1),
    )
    return backend, model


def test_fp16_overflow_skips_the_step_and_lowers_the_scale():
    backend, model = _prepared()
    x = torch.ones(2, 4)
    backend.backward(model(x).sum())
    _, skipped, scale0 = backend.step()
    assert not skipped and scale0 == 2.0**16
    before = [p.detach().clone() for p in model.parameters()]
    backend.backward(model(x).sum() * float("inf"))  # an injected inf gradient
    _, skipped, scale = backend.step()
    assert skipped and scale < scale0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the step was skipped
    backend.backward(model(x).sum())
    _, skipped, _ = backend.step()
    assert not skipped and not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # training goes on


def test_bf16_autocast_runs():
    backend, model = _prepared("bf16")
    with backend.autocast():
        y = model(torch.ones(2, 4))
    assert y.dtype == torch.bfloat16


def test_accumulation_steps():
    cfg = TrainConfig(batch_size=4, global_batch_size=32)
    assert cfg.accumulation_steps(2) == 4 and cfg.accumulation_steps(8) == 1
    with pytest.raises(ValueError, match="global_batch_size 32 is not a multiple"):
        cfg.accumulation_steps(3)


@pytest.mark.parametrize(
    "env,launcher,rank,world,local,node",
    [
        ({}, "none", 0, 1, 0, 0),
        (
            {
                "TORCHELASTIC_RUN_ID": "x",
                "RANK": "3",
                "WORLD_SIZE": "4",
                "LOCAL_RANK": "1",
                "LOCAL_WORLD_SIZE": "2",
                "GROUP_RANK": "1",
            },
            "torchrun",
            3,
            4,
            1,
            1,
        ),
        (
            {"CROSS_RANK": "1", "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_SIZE": "4"},
            "deepspeed",
            5,
            8,
            1,
            1,
        ),
        (
            {
                "HOROVOD_RANK": "2",
                "HOROVOD_SIZE": "4",
                "HOROVOD_LOCAL_RANK": "0",
                "HOROVOD_LOCAL_SIZE": "2",
                "HOROVOD_CROSS_RANK": "1",
            },
            "horovod",
            2,
            4,
            0,
            1,
        ),
        (
            {
                "OMPI_COMM_WORLD_RANK": "1",
                "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            },
            "mpi",
            1,
            2,
            1,
            0,
        ),
        ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, "mpi", 1, 2, 1, 0),
        (
            {
                "SLURM_PROCID": "6",
                "SLURM_NTASKS": "8",
                "SLURM_LOCALID": "2",
                "SLURM_NODEID": "1",
                "SLURM_JOB_NODELIST": "gpu[07-08]",
            },
            "slurm",
            6,
            8,
            2,
            1,
        ),
    ],
)
def test_topology_from_each_launcher(env, launcher, rank, world, local, node):
    t = topology_from_env(env)
    assert (t.launcher, t.rank, t.world_size, t.local_rank, t.node_rank) == (launcher, rank, world, local, node)
    if launcher == "slurm":
        assert t.master_addr == "gpu07"


@pytest.mark.launcher
def test_backend_choice_and_refusals():
    assert resolve_backend("auto", Topology("none")) == "single"
    assert resolve_backend("auto", Topology("torchrun", world_size=2)) == "ddp"
    assert resolve_backend("auto", Topology("deepspeed", world_size=2)) == "deepspeed"
    assert resolve_backend("auto", Topology("horovod", world_size=2)) == "horovod"
    # N processes that would each train alone: refused, never silent
    with pytest.raises(ValueError, match="unsynchronized"):
        resolve_backend("single", Topology("torchrun", world_size=2))


def test_zero_memory_formulas_and_auto_stage():
    psi = 1_000_000
    assert zero_memory_bytes(psi, 0, 4, "bf16") == 16 * psi
    assert zero_memory_bytes(psi, 1, 4, "bf16") == (4 + 12 / 4) * psi
    assert zero_memory_bytes(psi, 2, 4, "bf16") == (2 + 14 / 4) * psi
    assert zero_memory_bytes(psi, 3, 4, "bf16") == 16 / 4 * psi
    act = 1e6
    need = {s: zero_memory_bytes(psi, s, 4, "bf16") + act for s in range(4)}
    for stage in range(4):  # a budget just above each stage's need picks exactly that stage
        budget = need[stage] / 0.8 * 1.001
        assert choose_zero_stage(psi, act, budget, 4, "bf16")[0] == stage
    with pytest.raises(ValueError, match="no ZeRO stage fits"):
        choose_zero_stage(psi, act, need[3] / 0.8 * 0.99, 4, "bf16")


def test_deepspeed_config_from_flags():
    cfg, conflicts = build_config(
        micro_batch=4,
        accumulation_steps=2,
        world_size=2,
        clip_grad_norm=0.0,
        precision="fp16",
        zero_stage=2,
        on_gpu=True,
        loss_scale_window=500,
    )
    assert cfg["train_batch_size"] == 16 and cfg["gradient_clipping"] == 0.0  # always explicit
    assert cfg["fp16"]["loss_scale_window"] == 500 and cfg["zero_optimization"]["stage"] == 2
    assert not conflicts
    user = {"gradient_clipping": 0.5, "zero_optimization": {"stage": 3, "overlap_comm": True}}
    cfg, conflicts = build_config(
        micro_batch=4,
        accumulation_steps=1,
        world_size=2,
        clip_grad_norm=1.0,
        precision="bf16",
        zero_stage=1,
        on_gpu=False,
        user_config=user,
    )
    assert cfg["gradient_clipping"] == 0.5 and cfg["zero_optimization"] == {"stage": 3, "overlap_comm": True}
    assert "torch_autocast" in cfg and len(conflicts) == 2
    with pytest.raises(ValueError, match="needs a GPU"):
        build_config(
            micro_batch=1,
            accumulation_steps=1,
            world_size=1,
            clip_grad_norm=1.0,
            precision="fp16",
            zero_stage=0,
            on_gpu=False,
        )


def test_elastic_horovod_refuses_what_depends_on_the_worker_count(monkeypatch):
    """Workers that join an elastic run compute these anew at another world size: they must not depend on it."""
    horovod_backend = pytest.importorskip("distributed.horovod_backend")

    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    backend = horovod_backend.HorovodBackend(Topology("horovod"))
    assert backend.recovery().world_size_may_change
    with pytest.raises(ValueError, match="--commit_every must be at least 1"):
        horovod_backend.HorovodBackend(Topology("horovod"), options=HorovodOptions(commit_every=0)).recovery()
    with pytest.raises(ValueError, match="set --steps"):
        TrainConfig(steps=0).check_elastic()
    with pytest.raises(ValueError, match="drop --global_batch_size"):
        TrainConfig(steps=10, batch_size=4, global_batch_size=64).check_elastic()
    TrainConfig(steps=10).check_elastic()
    monkeypatch.delenv("HOROVOD_ELASTIC")
    assert not horovod_backend.HorovodBackend(Topology("horovod")).recovery().world_size_may_change
    assert not make_backend("single", Topology("none")).recovery().world_size_may_change


def test_the_backend_interface_is_narrow():
    """What the loop and the scripts may use of a backend; a new public name is a decision, made here."""
    contract = {
        *("setup", "teardown", "prepare", "recovery"),  # lifecycle; the backend makes its own recovery
        *("accumulate", "autocast", "backward", "step"),  # one optimizer step, whatever the backend
        *("all_reduce", "all_reduce_async", "all_gather", "barrier"),  # collectives, on every rank
        "explain",  # which ranks stopped answering, when a collective timed out
        *("save_checkpoint", "load_checkpoint", "full_state_dict", "full_params"),  # state, sharded or whole
        *("weights", "load_extra"),  # the weights as this rank holds them, and what is kept in their layout (EMA)
        "forward_watch",  # where the collectives inside a forward are, for each rank's own time (rank_stats.py)
        *("is_main", "rank", "world_size", "topo", "device", "name"),  # where this process stands
    }
    backend = make_backend("single", Topology("none"), StepOptions())
    backend.setup()
    try:
        public = {n for n in dir(backend) if not n.startswith("_")}
    finally:
        backend.teardown()
    assert public == contract, sorted(public ^ contract)
    # the others need their launchers' process groups to set up: their classes add nothing public
    from distributed.deepspeed_backend import DeepSpeedBackend
    from distributed.horovod_backend import HorovodBackend
    from distributed.torch_ddp import DDPBackend
    from distributed.torch_fsdp import FSDPBackend

    for cls in (DDPBackend, FSDPBackend, DeepSpeedBackend, HorovodBackend):
        added = {n for n in dir(cls) if not n.startswith("_")} - contract
        assert not added, f"{cls.__name__} adds {sorted(added)}"
