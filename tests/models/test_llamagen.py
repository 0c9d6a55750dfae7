"""LlamaGen's checkpoints read into our models, checked against LlamaGen's own code: its figures on the same
files (tests/llamagen_files.py) were recorded by scripts/record_llamagen.py at the commit tests/fixtures/llamagen.json
names. Codes equal, decoded images and logits within 1e-4. "real" is LlamaGen's VQ-16 and GPT-XL at full width
(slow tier); "small" the same layouts narrow."""

from __future__ import annotations

import json
import os

import llamagen_files as files
import pytest
import torch

from dalle_pytorch.inference.load import load_vae
from dalle_pytorch.models import llamagen
from dalle_pytorch.models.dalle import DALLE

FIGURES = json.load(open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "llamagen.json")))
SIZES = ["small", pytest.param("real", marks=pytest.mark.slow)]
TOL = 1e-4


def close(ours: torch.Tensor, theirs, what: str) -> None:
    theirs = torch.tensor(theirs)
    err = (ours.float() - theirs).abs().max().item()
    assert err <= TOL * max(1.0, theirs.abs().max().item()), f"{what}: off by {err:.2e} from LlamaGen's"


@pytest.fixture(scope="module")
def vq_files(tmp_path_factory):
    """path of each size's VQ file, saved as LlamaGen's training saves a checkpoint ({"model": ..., more})."""
    root = tmp_path_factory.mktemp("llamagen")

    def path(size: str) -> str:
        out = str(root / f"vq_{size}.pt")
        if not os.path.exists(out):
            torch.save({"model": files.vq_state_dict(size), "steps": 0}, out)
        return out

    return path


@pytest.mark.parametrize("size", SIZES)
def test_llamagen_vq_encodes_and_decodes_as_llamagen(size, vq_files):
    want = FIGURES["vq"][size]
    assert files.layout_hash(files.vq_state_dict(size)) == want["layout"]  # the names and shapes LlamaGen's model has
    vae, export = load_vae(vq_files(size), image_size=files.VQ[size]["image"])
    assert export["config"]["ch_mult"] == files.VQ[size]["ch_mult"] and export["config"]["z_channels"]
    images = (files.images(size) + 1) / 2  # our tokenizers read [0, 1]
    codes = vae.get_codebook_indices(images)
    assert codes.tolist() == [sum(rows, []) for rows in want["codes"]], "codes differ from LlamaGen's"
    f = vae.cfg.fmap_size
    with torch.no_grad():
        decoded = vae.decode_vectors(torch.nn.functional.embedding(codes.view(-1, f, f), vae._codebook()))
    flat = decoded.flatten()
    close(flat[:: max(1, flat.numel() // 256)], want["decoded"]["strided"], "decoded image")
    close(decoded.mean(), want["decoded"]["mean"], "decoded mean")


def llamagen_dalle(size: str) -> DALLE:
    sd = files.gpt_state_dict(size)
    cfg = llamagen.gpt_config(sd, files.GPT[size]["fmap"], "test")
    dalle = DALLE(cfg)
    dalle.load_state_dict(llamagen.gpt_weights(sd, cfg, "test"))
    return dalle.eval()


@pytest.mark.parametrize("size", SIZES)
def test_llamagen_gpt_logits_equal_llamagen(size):
    want = FIGURES["gpt"][size]
    dalle = llamagen_dalle(size)
    assert dalle.cfg.heads == {"small": 2, "real": 20}[size] and dalle.cfg.llamagen_layout
    feats, tokens = files.captions(size), files.image_tokens(size)
    t = dalle.cfg.text_seq_len
    with torch.no_grad():
        logits = dalle.logits(feats, tokens)[:, t - 1 :]  # the image positions (no text vocabulary)
    close(logits[..., :8], want["forward"]["head"], "logits")
    close(logits.logsumexp(-1), want["forward"]["lse"], "log-partition")
    # guidance: prefill [cond, null] rows (the null row under the caption's mask), then decode steps
    steps = len(want["guided_steps"]["lse"][0]) - 1
    cache = dalle.new_cache(4, "cpu")
    null = torch.tensor([False, False, True, True])
    with torch.no_grad():
        out = [dalle.prefill(torch.cat([feats, feats]), cache, None, null)]
        for k in range(steps):
            token = torch.cat([tokens[:, k], tokens[:, k]])
            out.append(dalle.decode_step(token, torch.tensor(t + k), cache))
    guided = torch.stack(out, dim=1)
    close(guided[..., :8], want["guided_steps"]["head"], "guided logits")
    close(guided.logsumexp(-1), want["guided_steps"]["lse"], "guided log-partition")


def test_a_file_that_is_not_llamagens_is_one_line(tmp_path):
    sd = files.vq_state_dict("small")
    sd["encoder.extra.weight"] = torch.zeros(1)
    path = str(tmp_path / "odd.pt")
    torch.save({"model": sd}, path)
    with pytest.raises(ValueError, match=r"LlamaGen's model has no place for"):
        load_vae(path)
    del sd["encoder.extra.weight"]
    sd["quant_conv.weight"] = torch.zeros(8, 16, 1, 1)
    torch.save({"model": sd}, path)
    with pytest.raises(ValueError, match=r"quant_conv.weight is \(8, 16, 1, 1\), LlamaGen's layout says"):
        load_vae(path)
    torch.save({"model": files.vq_state_dict("small")}, path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ValueError, match="truncated or corrupted"):
        load_vae(path)
