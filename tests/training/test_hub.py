"""The Hub as users share models, offline (this machine has no Hub): a run's model folder (model.safetensors, its
config, a model card with its command, data and figures) put into a Hugging Face cache as `hf download` leaves it,
then read by name with HF_HUB_OFFLINE=1 by generate.py in its own process; a name missing from the cache, and an
upload without a network, are one line each. LlamaGen's files by Hub name: tests/training/test_llamagen_runs.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import ROOT
from test_trainers import TINY_VAE, tiny_dalle

import train_dalle
import train_vae
from dalle_pytorch import hub

pytestmark = pytest.mark.e2e
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def put_in_cache(cache: str, repo: str, folder: str) -> None:
    """The folder as huggingface_hub's cache holds a downloaded snapshot: blobs linked from snapshots/COMMIT,
    refs/main naming the commit (what `hf download` writes)."""
    root = os.path.join(cache, "models--" + repo.replace("/", "--"))
    snapshot = os.path.join(root, "snapshots", COMMIT)
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    shutil.copytree(folder, snapshot)
    with open(os.path.join(root, "refs", "main"), "w") as f:
        f.write(COMMIT)


def run(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_run_pushed_as_a_model_folder_loads_by_name_offline(tmp_path):
    vae = train_vae.main([*TINY_VAE, "--steps", "1", "--output_dir", str(tmp_path / "vae")])
    train_dalle.main([*tiny_dalle(vae), "--steps", "2", "--output_dir", str(tmp_path)])
    run_dir = str(tmp_path / "dalle")
    folder = hub.write_folder(run_dir, str(tmp_path / "folder"))
    assert sorted(os.listdir(folder)) == ["README.md", "config.json", "config.yaml", "model.safetensors"]
    card = open(os.path.join(folder, "README.md")).read()
    assert "python train_dalle.py --config config.yaml" in card and "built-in synthetic" in card and "| loss |" in card
    assert "global batch 8 on 1 ranks (single)" in card
    assert json.load(open(os.path.join(folder, "config.json")))["kind"] == "dalle"

    cache = str(tmp_path / "hf")
    put_in_cache(cache, "someone/tiny-dalle", folder)
    env = {**os.environ, "HF_HUB_CACHE": cache, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    out = str(tmp_path / "images")
    done = run(["generate.py", "--dalle_path", "someone/tiny-dalle", "--text", "a red circle", "--num_images", "1",
                "--outputs_dir", out], env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert os.listdir(os.path.join(out, "a_red_circle"))

    missing = run(["generate.py", "--dalle_path", "someone/other", "--text", "x", "--outputs_dir", out], env)
    assert missing.returncode == 2 and "HF_HUB_OFFLINE" in missing.stderr and "hf download" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1, missing.stderr

    pushed = run(["-m", "dalle_pytorch.hub", "push", run_dir, "someone/tiny-dalle"], env)
    assert pushed.returncode == 2 and "needs the Hub" in pushed.stderr and "hf upload" in pushed.stderr
    assert len(pushed.stderr.strip().splitlines()) == 1, pushed.stderr
    assert os.path.exists(os.path.join(run_dir, "hub", "model.safetensors"))  # written before the upload failed
