"""What a run hands back: RGBA models keep their alpha channel (sample grids, generated images, priming), and
Weights & Biases, when on, receives the sample grids and the export."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
from helpers import ONE_THREAD
from PIL import Image

import generate
import train_dalle
import train_vae

RUN = ["--steps", "2", "--batch_size", "4", "--num_workers", "0", "--sample_every", "1", *ONE_THREAD]
VAE = ["--image_size", "16", "--num_tokens", "16", "--hidden_dim", "16", "--codebook_dim", "16", "--channels", "4"]
DALLE = [
    "--dim",
    "32",
    "--depth",
    "1",
    "--heads",
    "2",
    "--dim_head",
    "16",
    "--text_seq_len",
    "8",
    "--tokenizer",
    "byte",
]


@pytest.fixture(scope="module")
def rgba_folder(tmp_path_factory):
    """Circles on a transparent background, each with its caption."""
    root = tmp_path_factory.mktemp("rgba")
    rng = np.random.default_rng(0)
    for i in range(8):
        pixels = np.zeros((16, 16, 4), dtype=np.uint8)
        y, x = np.mgrid[:16, :16]
        inside = (y - 8) ** 2 + (x - 8) ** 2 < rng.integers(9, 49)
        pixels[inside] = [*rng.integers(0, 255, 3), 255]
        Image.fromarray(pixels, "RGBA").save(root / f"{i}.png")
        (root / f"{i}.txt").write_text("a circle\n")
    return root


def _alpha_varies(path: str) -> bool:
    image = Image.open(path)
    assert image.mode == "RGBA", f"{path} is {image.mode}"
    return len(np.unique(np.asarray(image)[..., 3])) > 1


@pytest.mark.e2e
def test_rgba_runs_keep_their_alpha(rgba_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = str(tmp_path / "runs")
    vae = train_vae.main([*VAE, *RUN, "--image_folder", str(rgba_folder), "--output_dir", out, "--wandb"])
    assert _alpha_varies(os.path.join(out, "vae", "samples", "step-00000001.png"))
    # Weights & Biases (offline here) got the sample grids as images, and the export as a model artifact
    run_dir = glob.glob(os.path.join(out, "vae", "wandb", "offline-run-*"))[0]
    assert glob.glob(os.path.join(run_dir, "files", "media", "images", "samples_*.png"))
    assert glob.glob(os.path.join(run_dir, "*.wandb"))

    dalle = train_dalle.main(
        [*DALLE, *RUN, "--vae_path", vae, "--image_text_folder", str(rgba_folder), "--output_dir", out]
    )
    assert Image.open(os.path.join(out, "dalle", "samples", "step-00000001.png")).mode == "RGBA"
    (folder,) = generate.main(
        ["--dalle_path", dalle, "--text", "a circle", "--num_images", "2", "--outputs_dir", str(tmp_path / "gen"),
         "--img", str(rgba_folder / "0.png"), "--num_init_img_tokens", "4", "--quiet"]
    )  # fmt: skip
    for name in ("0000.png", "grid.png"):
        assert Image.open(os.path.join(folder, name)).mode == "RGBA"
