"""The one loop, driven by a fake Task in milliseconds: accumulation, resume, SIGTERM, export, and 2 ranks by
fork + Gloo (no launcher). The trainers' tests (test_trainers.py) run the same loop through the scripts."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import sys

import pytest
import torch
from multirank import on_ranks
from torch import nn

from dalle_pytorch.training.checkpoints import step_dirs
from dalle_pytorch.training.configs import TrainConfig
from dalle_pytorch.training.loop import Position, train
from dalle_pytorch.training.plan import RunPlan
from dalle_pytorch.training.session import training_session
from dalle_pytorch.training.signals import Stopped


class FakeTask:
    """A linear regression: y = x w + noise, 64 samples. `on_loss(step)` lets a test act mid-run."""

    name = "fake"
    tokens_per_sample = 1

    def __init__(self, export_path: str, on_loss=None, samples: int = 64):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(samples, 4, generator=g)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(samples, 1, generator=g)
        torch.manual_seed(1)
        self.model = nn.Linear(4, 1)
        self.dataset = torch.utils.data.TensorDataset(x, y)
        xv = torch.randn(32, 4, generator=g)  # held out: the same law, other draws
        yv = xv @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(32, 1, generator=g)
        self.val_dataset = torch.utils.data.TensorDataset(xv, yv)
        self.export_path = export_path
        self.on_loss = on_loss
        self.samples_written: list[int] = []

    def activation_bytes(self, batch_size: int) -> float:
        return 16.0 * batch_size

    def prepare_batch(self, batch, device):
        return [t.to(device) for t in batch]

    def loss(self, model, batch, step):
        if self.on_loss:
            self.on_loss(step)
        x, y = batch
        loss = nn.functional.mse_loss(model(x), y)
        return loss, {"mse": loss.detach()}

    def window_metrics(self):
        return {}

    def val_scores(self, whole_model, rank, world_size):
        return {}

    def write_samples(self, model, step, path):
        self.samples_written.append(step)

    def export(self, weights, ema=None):
        torch.save(weights, self.export_path)
        self.ema_export = ema


def config(tmp_path, **overrides) -> TrainConfig:
    base = dict(
        steps=8, batch_size=8, learning_rate=0.05, num_workers=0, output_dir=str(tmp_path), name="run",
        log_every=1000, sample_every=0, save_every_n_steps=0, tensorboard=False, quiet=True, threads=1,
        distributed_backend="single",
    )  # fmt: skip
    return TrainConfig(**{**base, **overrides})


@dataclasses.dataclass
class StoppedAt(Position):
    """Where a run that SIGTERM stopped (train raised Stopped) saved its checkpoint."""


def fit(cfg: TrainConfig, task: FakeTask):
    """(final position, trained weights) of one run of the loop, with the session the trainers use."""
    try:
        plan = RunPlan.make(cfg)
        with training_session(plan, "run", {"train": cfg}) as (backend, recovery, run):
            try:
                pos = train(task, plan.counted(task.dataset), backend, recovery, run)
            finally:
                weights = {k: v.detach().clone() for k, v in task.model.state_dict().items()}
    except Stopped as e:  # saved, not finished: the scripts exit with --exit_code_on_stop
        pos = StoppedAt(step=e.step)
    return pos, weights


def test_the_loop_trains_and_exports(tmp_path):
    task = FakeTask(str(tmp_path / "fake.pt"))
    before = nn.functional.mse_loss(task.model(task.dataset.tensors[0]), task.dataset.tensors[1]).item()
    pos, weights = fit(config(tmp_path, steps=40), task)
    after = nn.functional.mse_loss(task.model(task.dataset.tensors[0]), task.dataset.tensors[1]).item()
    assert pos.step == 40 and after < before / 2
    exported = torch.load(tmp_path / "fake.pt", weights_only=True)
    assert exported.keys() == weights.keys() and all(torch.equal(exported[k], weights[k]) for k in weights)
    assert os.path.basename(step_dirs(str(tmp_path / "run" / "checkpoints"))[0]) == "step-00000040"  # the final one


def test_accumulation_equals_the_whole_batch(tmp_path):
    """2 micro-batches of 8 per step give the step of one batch of 16 (the backend averages them)."""
    _, whole = fit(config(tmp_path / "a", batch_size=16), FakeTask(str(tmp_path / "a.pt")))
    _, accumulated = fit(config(tmp_path / "b", batch_size=8, global_batch_size=16), FakeTask(str(tmp_path / "b.pt")))
    for k in whole:  # the same sums in another order: fp32 rounding only
        torch.testing.assert_close(accumulated[k], whole[k], rtol=0, atol=1e-6)


class Crash(RuntimeError):
    """Stands for a killed process: raised from inside the loop, caught by nothing but the test."""


def _crash_at(step):
    def on_loss(s):
        if s == step:
            raise Crash(f"step {s}")

    return on_loss


def test_resume_equals_the_uninterrupted_run(tmp_path):
    _, uninterrupted = fit(config(tmp_path / "a"), FakeTask(str(tmp_path / "a.pt")))
    with pytest.raises(Crash):
        fit(config(tmp_path / "b", save_every_n_steps=3), FakeTask(str(tmp_path / "b.pt"), on_loss=_crash_at(5)))
    newest = step_dirs(str(tmp_path / "b" / "run" / "checkpoints"))[0]  # beside the step-0 one written at the start
    assert os.path.basename(newest) == "step-00000003"
    pos, resumed = fit(config(tmp_path / "b", resume="auto"), FakeTask(str(tmp_path / "b.pt")))
    assert pos.step == 8
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)


def test_sigterm_saves_and_resumes(tmp_path):
    """SIGTERM during step 6 (log steps far away): a checkpoint right after that step, a clean stop, and the
    resumed run equals the uninterrupted one."""
    sent = []

    def sigterm_at_5(step):
        if step == 5 and not sent:
            sent.append(step)
            os.kill(os.getpid(), signal.SIGTERM)

    pos, _ = fit(config(tmp_path / "b", log_every=1000), FakeTask(str(tmp_path / "b.pt"), on_loss=sigterm_at_5))
    assert sent and pos.step == 6 and isinstance(pos, StoppedAt)
    assert os.path.basename(step_dirs(str(tmp_path / "b" / "run" / "checkpoints"))[0]) == f"step-{pos.step:08d}"
    _, uninterrupted = fit(config(tmp_path / "a"), FakeTask(str(tmp_path / "a.pt")))
    pos, resumed = fit(config(tmp_path / "b", resume="auto"), FakeTask(str(tmp_path / "b.pt")))
    assert pos.step == 8 and all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)


def _fit_on_rank(rank, out, backend):
    fit(config(out, distributed_backend=backend, batch_size=8), FakeTask(os.path.join(out, "fake.pt")))
    return torch.load(os.path.join(out, "fake.pt"), weights_only=True)  # the export rank 0 wrote, full weights


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_two_ranks_equal_one_process(tmp_path, backend):
    """2 forked ranks x batch 8 equal one process with batch 16 (Gloo, no launcher); the real launchers'
    version of this check is tests/launchers/test_launchers.py."""
    _, single = fit(config(tmp_path / "one", batch_size=16), FakeTask(str(tmp_path / "one.pt")))
    os.makedirs(tmp_path / "two")
    exported, _ = on_ranks(2, _fit_on_rank, str(tmp_path / "two"), backend)
    assert exported.keys() == single.keys()
    for k in single:  # the same sums in another order: fp32 rounding only
        torch.testing.assert_close(exported[k], single[k], rtol=0, atol=1e-6)


def _sigterm_rank_1_during_step_4(rank, out, resume):
    def on_loss(step):
        if rank == 1 and step == 3 and not resume:
            os.kill(os.getpid(), signal.SIGTERM)

    cfg = config(out, distributed_backend="ddp", log_every=1000, resume=resume)
    pos, weights = fit(cfg, FakeTask(os.path.join(out, "fake.pt"), on_loss=on_loss))
    return (pos.step, isinstance(pos, StoppedAt)), weights


def _fit_ddp(rank, out):
    return fit(config(out, distributed_backend="ddp"), FakeTask(os.path.join(out, "fake.pt")))[1]


def test_sigterm_on_one_rank_stops_every_rank_within_one_step(tmp_path):
    """Rank 1 alone is signalled during step 4, with --log_every far away: the ranks' vote, started each step
    and read the next, stops both after step 5 (one step later, at the same step on both), with a checkpoint;
    resumed, the run equals the uninterrupted one."""
    out = str(tmp_path / "b")
    os.makedirs(out)
    stopped = on_ranks(2, _sigterm_rank_1_during_step_4, out, "")
    assert [step for step, _ in stopped] == [(5, True), (5, True)]  # both stopped on SIGTERM, as rank 1 was
    assert [os.path.basename(d) for d in step_dirs(os.path.join(out, "run", "checkpoints"))][0] == "step-00000005"
    resumed = on_ranks(2, _sigterm_rank_1_during_step_4, out, "auto")
    assert [step for step, _ in resumed] == [(8, False), (8, False)]
    os.makedirs(tmp_path / "a")
    uninterrupted = on_ranks(2, _fit_ddp, str(tmp_path / "a"))[0]
    assert all(torch.equal(resumed[0][1][k], uninterrupted[k]) for k in uninterrupted)


def test_a_save_that_cannot_fit_in_slurms_grace_period_is_said_once(monkeypatch):
    """Two steps (the vote is read a step late) and a checkpoint must fit in KillWait, read from scontrol."""
    from dalle_pytorch.training import signals

    monkeypatch.setattr(signals, "slurm_kill_wait", lambda: 30.0)
    lines = []
    check = signals.GraceCheck(lines.append, is_main=True, env={"SLURM_JOB_ID": "7"})
    check.saved(15.0)
    check.stepped(10.0)  # 2 x 10 + 15 = 35 s > 30 s
    check.stepped(12.0)
    assert len(lines) == 1 and "needs up to 35 s" in lines[0] and "KillWait 30 s" in lines[0], lines
    fits = signals.GraceCheck(lines.append, is_main=True, env={"SLURM_JOB_ID": "7"})
    fits.saved(5.0), fits.stepped(10.0)
    outside = signals.GraceCheck(lines.append, is_main=True, env={})
    outside.saved(100.0), outside.stepped(100.0)
    assert len(lines) == 1


RECORDER = """
from dalle_pytorch.training.hooks import Hooks

class Recorder(Hooks):
    events = []

    def on_start(self, ctx, step):
        self.events.append(("start", step, ctx.rank, ctx.world_size, ctx.task))

    def before_step(self, ctx, step):
        self.events.append(("before", step))

    def after_step(self, ctx, step):
        self.events.append(("after", step))

    def on_log(self, ctx, step, row):
        self.events.append(("log", step, round(row["loss"], 6) > 0))

    def on_save(self, ctx, step, path):
        self.events.append(("save", step, path.endswith(f"step-{step:08d}")))

    def on_end(self, ctx, step):
        self.events.append(("end", step))
"""


def test_hooks_see_every_event_in_order(tmp_path, monkeypatch):
    (tmp_path / "recorder.py").write_text(RECORDER)
    monkeypatch.syspath_prepend(str(tmp_path))
    import recorder

    fit(
        config(tmp_path, steps=4, log_every=2, save_every_n_steps=4, hooks="recorder:Recorder"),
        FakeTask(str(tmp_path / "x.pt")),
    )
    steps = [e for e in recorder.Recorder.events if e[0] in ("before", "after")]
    assert recorder.Recorder.events[0] == ("start", 0, 0, 1, "fake")
    assert steps == [(w, s) for k in range(4) for w, s in (("before", k), ("after", k + 1))]
    assert [e for e in recorder.Recorder.events if e[0] in ("log", "save", "end")] == [
        ("save", 0, True), ("log", 2, True), ("log", 4, True), ("save", 4, True), ("end", 4)
    ]  # fmt: skip


def test_the_early_stopping_example_stops_the_run_with_a_checkpoint(tmp_path, monkeypatch):
    """examples/hooks/early_stopping.py as a user names it: by its file. The first log (step 2) sets the best;
    no later one improves on it by 1e9, so with patience 2 it asks to stop at the third log (step 6), where
    the process stops."""
    from helpers import ROOT

    monkeypatch.setenv("EARLY_STOPPING_KEY", "loss")
    monkeypatch.setenv("EARLY_STOPPING_PATIENCE", "2")
    monkeypatch.setenv("EARLY_STOPPING_MIN_DELTA", "1e9")
    spec = os.path.join(ROOT, "examples", "hooks", "early_stopping.py") + ":EarlyStopping"
    cfg = config(tmp_path, steps=20, log_every=2, save_every_n_steps=100, hooks=spec)
    pos, _ = fit(cfg, FakeTask(str(tmp_path / "x.pt")))
    assert pos.step == 6 and os.path.exists(tmp_path / "x.pt")
    assert os.path.basename(step_dirs(str(tmp_path / "run" / "checkpoints"))[0]) == "step-00000006"
    assert "early stopping: loss" in (tmp_path / "run" / "train.log").read_text()


@pytest.mark.parametrize(
    "source,spec,message",
    [
        ("", "nowhere_module:X", "cannot import nowhere_module (ModuleNotFoundError"),
        ("class A: pass\n", "hk:B", "hk has no class B"),
        ("from dalle_pytorch.training.hooks import Hooks\nclass A(Hooks):\n    def on_logs(self, ctx, s, r): pass\n",
         "hk:A", "on_logs is no hook"),
        ("class A:\n    def on_log(self, ctx, s, r): pass\n", "hk:A", "A lacks on_start, before_step"),
        ("", "hk", "expected MODULE:CLASS"),
    ],
)  # fmt: skip
def test_a_hook_that_cannot_load_says_so_before_training(tmp_path, monkeypatch, source, spec, message):
    (tmp_path / "hk.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "hk", raising=False)  # each case's own module
    task = FakeTask(str(tmp_path / "x.pt"))
    with pytest.raises(ValueError, match=re.escape(message)):
        fit(config(tmp_path, hooks=spec), task)
    assert not (tmp_path / "run" / "checkpoints").exists() or not os.listdir(tmp_path / "run" / "checkpoints")


def _val_losses(run_dir):
    import json

    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}


def _fit_with_validation(rank, out):
    cfg = config(out, distributed_backend="ddp", batch_size=8, val_every=2, val_batches=2)
    fit(cfg, FakeTask(os.path.join(out, "fake.pt")))
    return _val_losses(os.path.join(out, "run")) if rank == 0 else None


def test_validation_loss_is_the_same_on_one_process_and_two_ranks(tmp_path):
    """--val_every 2: the loss on the held-out samples, every 2 steps, in metrics.jsonl; 2 ranks x batch 8 see
    the same 32 samples as 1 process x batch 16 and report the same loss (the mean over ranks)."""
    cfg = config(tmp_path / "one", batch_size=16, val_every=2, val_batches=2)
    fit(cfg, FakeTask(str(tmp_path / "one.pt")))
    one = _val_losses(str(tmp_path / "one" / "run"))
    assert sorted(one) == [2, 4, 6, 8] and one[8] < one[2]  # it learns the held-out law too
    os.makedirs(tmp_path / "two")
    two = on_ranks(2, _fit_with_validation, str(tmp_path / "two"))[0]
    assert two.keys() == one.keys() and all(abs(two[s] - one[s]) < 1e-5 for s in one), (one, two)


def test_held_out_samples_as_the_flags_say(tmp_path):
    from dalle_pytorch.data.build import DataSpec
    from dalle_pytorch.data.shapes import ShapesDataset
    from dalle_pytorch.training.data import held_out
    from distributed import Topology, make_backend

    backend = make_backend("single", Topology("none"))
    data = ShapesDataset(100, 16)
    spec = DataSpec("", "--image_text_folder", "", True, 16, 3, 1.0)
    assert held_out(config(tmp_path), backend, data, spec) == (data, None)
    train, val = held_out(config(tmp_path, val_every=5, val_fraction=0.2), backend, data, spec)
    assert (len(train), len(val)) == (80, 20) and not set(train.indices) & set(val.indices)
    assert train.split == "train"  # still answers for the whole dataset
    same, fresh = held_out(config(tmp_path, val_every=5, batch_size=4, val_batches=3), backend, data, spec)
    assert same is data and len(fresh) == 12 and fresh[0][1] != data[0][1]  # the built-in data: its own samples
    for overrides, message in (
        (dict(val_fraction=0.2), "--val_fraction is read every --val_every N steps"),
        (dict(val_every=5, val_fraction=1.5), "--val_fraction must be between 0 and 1"),
    ):
        with pytest.raises(ValueError, match=message):
            held_out(config(tmp_path, **overrides), backend, data, spec)
    with pytest.raises(ValueError, match="--val_image_text_folder is read every"):
        held_out(config(tmp_path), backend, data, dataclasses.replace(spec, val_folder=str(tmp_path)))


def test_early_stopping_on_the_validation_loss(tmp_path, monkeypatch):
    """The example's default: val_loss, every --val_every steps. With a patience of 1 and no improvement of
    1e9 possible, the second evaluation (step 4) asks to stop, and the process stops there."""
    from helpers import ROOT

    monkeypatch.setenv("EARLY_STOPPING_PATIENCE", "1")
    monkeypatch.setenv("EARLY_STOPPING_MIN_DELTA", "1e9")
    spec = os.path.join(ROOT, "examples", "hooks", "early_stopping.py") + ":EarlyStopping"
    cfg = config(tmp_path, steps=20, val_every=2, val_batches=1, hooks=spec)
    pos, _ = fit(cfg, FakeTask(str(tmp_path / "x.pt")))
    assert pos.step == 4 and "early stopping: val_loss" in (tmp_path / "run" / "train.log").read_text()
