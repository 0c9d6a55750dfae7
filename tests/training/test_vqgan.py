"""train_vae.py --model vqgan: its export works wherever the dVAE's does (train_dalle.py --vae_path with
--precompute_tokens, the encode command, generate.py, the evaluation), config.yaml relaunches it, its perceptual
loss is torchmetrics' LPIPS on the given VGG-16 file, and bad flags are one line each."""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest
import torch
from helpers import ONE_THREAD, TINY_DALLE_MODEL

import generate
import train_dalle
import train_vae
from dalle_pytorch.data.shapes_export import export_wds
from dalle_pytorch.eval import evaluate
from dalle_pytorch.inference.load import load_vae
from dalle_pytorch.models.vq_tokenizer import VQTokenizer
from dalle_pytorch.training import encode

pytestmark = pytest.mark.e2e
MODEL = ["--model", "vqgan", "--image_size", "16", "--num_tokens", "16", "--hidden_dim", "32", "--num_layers", "1"]
MODEL += ["--disc_hidden_dim", "16", "--disc_layers", "1", "--disc_start", "2"]
RUN = [*ONE_THREAD, "--batch_size", "8", "--num_workers", "0", "--quiet", "--dataset_size", "64", "--steps", "4"]
RUN += ["--sample_every", "2", "--log_every", "2"]


@pytest.fixture(scope="module")
def vqgan(vgg16, tmp_path_factory):
    out = tmp_path_factory.mktemp("vqgan")
    return train_vae.main([*MODEL, *RUN, "--perceptual_weights", vgg16, "--output_dir", str(out), "--ema", "0.9"])


def test_a_vqgan_trains_logs_its_health_and_exports_the_tokenizer_alone(vqgan):
    run = os.path.dirname(vqgan)
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    for name in ("recon", "perceptual", "commitment", "g_loss", "d_loss", "d_real_accuracy", "d_fake_accuracy"):
        assert all(name in r for r in rows), name
    assert all(0 < r["codebook_usage"] <= 1 and r["codebook_perplexity"] >= 1 for r in rows)
    assert os.path.exists(os.path.join(run, "samples", "step-00000002.png"))
    vae, export = load_vae(vqgan)
    assert isinstance(vae, VQTokenizer) and export["config"]["model"] == "vqgan" and "ema" in export
    assert not [k for k in export["weights"] if k.startswith("discriminator")]
    assert vae.get_codebook_indices(torch.rand(2, 3, 16, 16)).shape == (2, 64)
    assert "VQGAN: the discriminator's losses start at step 2" in open(os.path.join(run, "train.log")).read()


def test_its_export_serves_dalle_training_encoding_generation_and_evaluation(vqgan, tmp_path, monkeypatch, capsys):
    flags = ["--vae_path", vqgan, *TINY_DALLE_MODEL, *ONE_THREAD, "--batch_size", "4", "--num_workers", "0"]
    flags += ["--quiet", "--dataset_size", "32", "--steps", "2", "--sample_every", "0"]
    dalle = train_dalle.main([*flags, "--precompute_tokens", "--output_dir", str(tmp_path)])
    folders = generate.main(["--dalle_path", dalle, "--text", "a red circle", "--num_images", "2", "--outputs_dir",
                             str(tmp_path / "out"), "--quiet"])  # fmt: skip
    assert len([f for f in os.listdir(folders[0]) if f.endswith(".png")]) == 3  # 2 images and the grid
    export_wds(str(tmp_path / "shards"), 12, image_size=16, per_shard=6)
    assert encode.main(["--shards", str(tmp_path / "shards"), "--wds", "png,txt", "--vae_path", vqgan,
                        "--out", str(tmp_path / "tokens")]) == 0  # fmt: skip
    assert sorted(f for f in os.listdir(tmp_path / "tokens") if f.endswith(".tar")) == [
        "tokens-000000.tar",
        "tokens-000001.tar",
    ]
    results = evaluate.main(["--vae_path", vqgan, "--out", str(tmp_path / "eval")])["vae"]
    assert results["psnr"] > 0 and 0 < results["codebook_usage"] <= 1


def test_config_yaml_relaunches_a_vqgan(vqgan, tmp_path):
    config = os.path.join(os.path.dirname(vqgan), "config.yaml")
    export = train_vae.main(["--config", config, "--output_dir", str(tmp_path), "--steps", "2"])
    assert load_vae(export)[1]["config"] == load_vae(vqgan)[1]["config"]


def test_the_perceptual_loss_is_torchmetrics_lpips_on_that_file(vgg16):
    """Ours (VGG-16 read from the file) against torchmetrics' own _LPIPS building its VGG-16 with torchvision's
    pretrained weights, here that same file."""
    import torchvision
    from torchmetrics.functional.image.lpips import _LPIPS

    from dalle_pytorch.training.perceptual import lpips_vgg

    build = torchvision.models.vgg16

    def vgg16_from_file(weights=None, **_):
        model = build()
        if weights is not None:
            model.load_state_dict(torch.load(vgg16, weights_only=True))
        return model

    with mock.patch.object(torchvision.models, "vgg16", vgg16_from_file):
        theirs = _LPIPS(pretrained=True, net="vgg", pnet_rand=False).eval()
    ours = lpips_vgg(vgg16)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.rand(4, 3, 32, 32, generator=g) * 2 - 1 for _ in range(2))
    assert torch.allclose(ours(x, y), theirs(x, y), rtol=1e-5, atol=1e-7)
    assert not any(p.requires_grad for p in ours.parameters())


def test_bad_flags_are_one_line_each(vgg16, inception, tmp_path, capsys):
    def fails(*argv: str) -> str:
        with pytest.raises(SystemExit):
            train_vae.main([*RUN, "--output_dir", str(tmp_path), *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        return err[0]

    assert "--kl_div_loss_weight is a dVAE flag: --model vqgan does not read it" in fails(
        *MODEL, "--kl_div_loss_weight", "0.1"
    )
    assert "--starting_temp is a dVAE flag" in fails(*MODEL, "--starting_temp", "2")
    assert "--disc_start is read with --model vqgan" in fails("--disc_start", "5")
    assert "--disc_start 40 is beyond the run's 4 steps" in fails(*MODEL[:-2], "--disc_start", "40")
    assert "not torchvision's VGG-16" in fails(*MODEL, "--perceptual_weights", inception)
    assert "--perceptual_weights /nonexistent: no such file" in fails(*MODEL, "--perceptual_weights", "/nonexistent")
    assert "downsamples --image_size 16 below 1 pixel" in fails(
        *MODEL[:-8], "--num_layers", "5", "--perceptual_weight", "0"
    )
    assert "--hidden_dim must be a multiple of 32" in fails(*MODEL, "--hidden_dim", "48", "--perceptual_weight", "0")
