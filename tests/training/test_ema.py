"""--ema: the decay schedule, the average the loop keeps (against a replay of the formula), its resume, the
refusals; exports read with and without it. Multi-rank layouts: tests/launchers/test_launchers.py."""

from __future__ import annotations

import os

import pytest
import torch
from test_loop import Crash, FakeTask, _crash_at, config, fit

from dalle_pytorch.inference.export import export_weights
from dalle_pytorch.training.configs import TrainConfig
from dalle_pytorch.training.ema import ema_decay


def test_ema_decay_warms_up_then_holds():
    assert ema_decay(0, 0.999) == pytest.approx(0.1)  # the first update keeps 90% of the new weights
    assert ema_decay(90, 0.999) == pytest.approx(0.91)
    assert ema_decay(10**6, 0.999) == 0.999 and ema_decay(10**6, 0.5) == 0.5
    steps = [ema_decay(s, 0.99) for s in range(2000)]
    assert steps == sorted(steps) and steps[-1] == 0.99


def _recording(task: FakeTask, seen: dict):
    """seen[s]: the weights after s optimizer steps (as the loss of step s sees them)."""

    def on_loss(step):
        if step not in seen:
            seen[step] = {k: v.detach().clone() for k, v in task.model.named_parameters()}

    return on_loss


def test_the_loop_keeps_the_average_of_its_weights(tmp_path):
    """The exported average equals the formula replayed over the weights after each of the 8 steps."""
    task, seen = FakeTask(str(tmp_path / "fake.pt")), {}
    task.on_loss = _recording(task, seen)
    _, seen[8] = fit(config(tmp_path, ema=0.9), task)
    final, average = seen[8], dict(seen[0])
    for step in range(8):
        average = {k: torch.lerp(average[k], seen[step + 1][k], 1 - ema_decay(step, 0.9)) for k in average}
    assert task.ema_export["decay"] == 0.9
    exported = task.ema_export["weights"]
    for k in average:
        torch.testing.assert_close(exported[k], average[k], rtol=0, atol=1e-7)
        assert not torch.allclose(exported[k], final[k], atol=1e-3)  # it lags the weights


def test_the_average_resumes_with_the_checkpoint(tmp_path):
    whole = FakeTask(str(tmp_path / "a.pt"))
    fit(config(tmp_path / "a", ema=0.9), whole)
    with pytest.raises(Crash):
        fit(config(tmp_path / "b", ema=0.9, save_every_n_steps=3), FakeTask(str(tmp_path / "b.pt"), _crash_at(5)))
    resumed = FakeTask(str(tmp_path / "b.pt"))
    fit(config(tmp_path / "b", ema=0.9, resume="auto"), resumed)
    for k, v in whole.ema_export["weights"].items():
        assert torch.equal(resumed.ema_export["weights"][k], v), k


def test_a_checkpoint_without_an_average_starts_one_from_its_weights(tmp_path, capsys):
    with pytest.raises(Crash):
        fit(config(tmp_path, save_every_n_steps=3), FakeTask(str(tmp_path / "a.pt"), _crash_at(5)))
    task, seen = FakeTask(str(tmp_path / "b.pt")), {}
    task.on_loss = _recording(task, seen)
    _, seen[8] = fit(config(tmp_path, ema=0.9, resume="auto"), task)
    assert "holds no EMA (trained without --ema): the EMA starts from its weights" in capsys.readouterr().out
    assert min(seen) == 3  # resumed at the step-3 checkpoint, whose weights start the average
    average = dict(seen[3])
    for step in range(3, 8):
        average = {k: torch.lerp(average[k], seen[step + 1][k], 1 - ema_decay(step, 0.9)) for k in average}
    for k in average:
        torch.testing.assert_close(task.ema_export["weights"][k], average[k], rtol=0, atol=1e-7)


@pytest.mark.parametrize("decay", [1.0, 1.5, -0.1])
def test_a_decay_outside_0_1_is_refused(decay):
    with pytest.raises(ValueError, match=r"--ema must be a decay between 0 and 1, e.g. 0.999"):
        TrainConfig(ema=decay).validate()


def test_readers_take_the_average_unless_told_otherwise():
    raw = {"w": torch.zeros(2), "buffer": torch.ones(1)}
    plain = {"weights": raw}
    with_ema = {"weights": raw, "ema": {"decay": 0.9, "weights": {"w": torch.full((2,), 5.0)}}}
    assert export_weights(plain) is raw and export_weights(with_ema, "raw") is raw
    for which in ("auto", "ema"):
        chosen = export_weights(with_ema, which)
        assert torch.equal(chosen["w"], torch.full((2,), 5.0)) and chosen["buffer"] is raw["buffer"]
    with pytest.raises(ValueError, match="x.safetensors holds no EMA"):
        export_weights(plain, "ema", "x.safetensors")
    with pytest.raises(ValueError, match="--weights must be one of auto, ema, raw"):
        export_weights(plain, "best")


def test_generate_samples_the_average(tmp_path):
    """train_dalle.py --ema exports the average; generate.py uses it (--weights raw: the last step's)."""
    from helpers import TINY_DALLE_MODEL, TINY_VAE_MODEL

    import generate
    import train_dalle
    import train_vae
    from dalle_pytorch.files import safe_load
    from dalle_pytorch.inference.load import load_dalle

    common = ["--threads", "1", "--num_workers", "0", "--quiet", "--dataset_size", "64", "--steps", "3"]
    vae = train_vae.main([*TINY_VAE_MODEL, *common, "--batch_size", "8", "--output_dir", str(tmp_path)])
    path = train_dalle.main(
        [*TINY_DALLE_MODEL, *common, "--vae_path", vae, "--batch_size", "8", "--output_dir", str(tmp_path),
         "--ema", "0.99", "--learning_rate", "3e-3"]
    )  # fmt: skip
    export = safe_load(path)
    assert export["ema"]["decay"] == 0.99 and export["ema"]["weights"].keys() <= export["weights"].keys()
    by_default, raw = load_dalle(path)[0], load_dalle(path, weights="raw")[0]
    name = "transformer.layers.0.attn.to_qkv.weight"
    params = dict(by_default.named_parameters())
    name = name if name in params else next(iter(params))
    assert torch.equal(params[name], export["ema"]["weights"][name])
    assert torch.equal(dict(raw.named_parameters())[name], export["weights"][name])
    for which in ("auto", "raw"):
        folders = generate.main(
            ["--dalle_path", path, "--text", "a red circle", "--num_images", "1", "--weights", which,
             "--outputs_dir", str(tmp_path / which), "--quiet"]
        )  # fmt: skip
        assert any(f.endswith(".png") for f in os.listdir(folders[0]))
