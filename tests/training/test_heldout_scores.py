"""The parser's score of generated images for held-out captions during validation (DALLE on the built-in data):
which captions each rank takes, that each image is scored against its own caption's scene, the averages."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from dalle_pytorch.data.shapes import ShapesDataset
from dalle_pytorch.training import dalle_task
from dalle_pytorch.training.configs import TrainConfig
from dalle_pytorch.training.dalle_task import DALLETask
from dalle_pytorch.training.data import heldout_scenes


class Captions:
    """Caption i -> token i: the fake generator hands the token on, the fake VAE draws scene i + `shift`."""

    def __init__(self, heldout: ShapesDataset, shift: int):
        self.heldout, self.shift = heldout, shift
        self.captions = [heldout.caption(i) for i in range(len(heldout))]

    def tokenize(self, captions, length):
        return torch.tensor([[self.captions.index(c)] for c in captions]), 0

    def decode(self, tokens):
        return torch.stack([self.heldout[(int(t[0]) + self.shift) % len(self.heldout)][0] for t in tokens])


def scores(heldout, shift, rank, world_size, monkeypatch):
    fake = Captions(heldout, shift)
    model = nn.Linear(1, 1)
    model.cfg = type("Cfg", (), {"text_seq_len": 1, "seq_len": 2})
    monkeypatch.setattr(dalle_task, "generate_image_tokens", lambda model, text, **kw: text)
    task = DALLETask(model, fake, {}, fake, None, "", [], heldout=heldout)
    return task.val_scores(lambda: contextlib.nullcontext(model), rank, world_size)


def test_each_image_is_scored_against_its_own_caption(monkeypatch):
    heldout = ShapesDataset(8, 32, seed=5, split="heldout")
    right = scores(heldout, 0, 0, 1, monkeypatch)
    assert right["heldout_full"].item() == 1.0 and right["heldout_color"].item() == 1.0
    wrong = scores(heldout, 1, 0, 1, monkeypatch)  # every image drawn for the next caption
    assert wrong["heldout_full"].item() < 0.5
    # two ranks take disjoint equal shares; their mean is the one-process score
    halves = [scores(heldout, 1, r, 2, monkeypatch) for r in (0, 1)]
    for k, v in wrong.items():
        assert (halves[0][k] + halves[1][k]).item() / 2 == pytest.approx(v.item())


def test_heldout_scenes_only_for_the_built_in_data_with_validation():
    backend = type("Backend", (), {"world_size": 3})
    data = ShapesDataset(100, 32, seed=7)
    cfg = TrainConfig(val_every=5)
    scenes = heldout_scenes(data, 16, cfg, backend)
    assert len(scenes) == 15 and scenes.split == "heldout"  # a multiple of the ranks
    assert len(heldout_scenes(data, 2, cfg, backend)) == 3  # at least one per rank
    assert heldout_scenes(data, 0, cfg, backend) is None
    assert heldout_scenes(data, 16, TrainConfig(), backend) is None  # no --val_every
    assert heldout_scenes(torch.utils.data.TensorDataset(torch.zeros(4)), 16, cfg, backend) is None
    with pytest.raises(ValueError, match="--val_heldout_captions must be >= 0"):
        heldout_scenes(data, -1, cfg, backend)
