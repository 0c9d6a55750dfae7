"""Shards encoded once into token shards (python -m dalle_pytorch.training.encode, or --precompute_tokens with
--wds): every rank its shards, finished ones kept, and DALLE training from the codes as it trains from the images."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from helpers import ONE_THREAD, TINY_DALLE_MODEL, TINY_VAE_MODEL

import train_dalle
import train_vae
from dalle_pytorch.data.shapes_export import export_wds
from dalle_pytorch.files import safe_load
from dalle_pytorch.training import encode
from dalle_pytorch.training.checkpoints import step_dirs


@pytest.fixture(scope="module")
def vae_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("vae")
    args = [*TINY_VAE_MODEL, *ONE_THREAD, "--batch_size", "8", "--num_workers", "0", "--quiet", "--steps", "4"]
    return train_vae.main([*args, "--dataset_size", "64", "--output_dir", str(out), "--sample_every", "0"])


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    export_wds(str(out), 60, image_size=16, per_shard=8)  # 8 shards, the last of 4
    return str(out)


def _encode(shards, vae_path, out, rank, world, monkeypatch, capsys):
    for k, v in {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world}.items():
        monkeypatch.setenv(k, str(v))  # as torchrun sets them: topology_from_env reads them
    assert encode.main(["--shards", shards, "--wds", "png,txt", "--vae_path", vae_path, "--out", out]) == 0
    return capsys.readouterr()


def test_every_rank_encodes_its_shards_and_a_restart_keeps_the_finished_ones(
    shards, vae_path, tmp_path, monkeypatch, capsys
):
    out = str(tmp_path / "tokens")
    first = _encode(shards, vae_path, out, 1, 2, monkeypatch, capsys)
    assert "rank 1: encoded 4 shards; 4 of 8 are in" in first.out and "4 shards are not encoded yet" in first.err
    done = {f: os.path.getmtime(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".tar")}
    assert sorted(done) == [f"tokens-{i:06d}.tar" for i in (1, 3, 5, 7)]
    os.remove(os.path.join(out, "tokens-000003.tar"))  # as if the job died while writing it
    again = _encode(shards, vae_path, out, 1, 2, monkeypatch, capsys)
    assert "rank 1: encoded 1 shards" in again.out
    assert all(os.path.getmtime(os.path.join(out, f)) == t for f, t in done.items() if f != "tokens-000003.tar")
    rank0 = _encode(shards, vae_path, out, 0, 2, monkeypatch, capsys)
    assert "rank 0: encoded 4 shards; 8 of 8 are in" in rank0.out
    with open(os.path.join(out, "tokens-000007_stats.json")) as f:
        assert json.load(f)["successes"] == 4
    from dalle_pytorch.data.shards import open_shard

    sample = open_shard(os.path.join(out, "tokens-000000.tar")).read(0)
    assert sorted(sample) == ["__key__", "codes.npy", "txt"] and sample["__key__"] == "00000000"


def _dalle(vae_path, tmp_path, *extra):
    args = [
        "--vae_path", vae_path, *TINY_DALLE_MODEL, *ONE_THREAD, "--batch_size", "4", "--num_workers", "2", "--quiet",
        "--steps", "9", "--save_every_n_steps", "4", "--keep_n_checkpoints", "5", "--sample_every", "0",
        "--resize_ratio", "1.0", "--output_dir", str(tmp_path), *extra,
    ]  # fmt: skip
    return train_dalle.main(args), args


def _weights(path):
    return safe_load(path)["weights"]


@pytest.mark.e2e
def test_training_from_codes_equals_training_from_images_and_resumes_exactly(shards, vae_path, tmp_path):
    """The same samples, captions and crops (a centre crop: --resize_ratio 1): the VAE run on the fly, the codes
    encoded by --precompute_tokens, and a resume after step 4 from the codes all end with the same weights."""
    images, _ = _dalle(vae_path, tmp_path / "images", "--wds", "png,txt", "--image_text_folder", shards)
    codes, args = _dalle(
        vae_path, tmp_path / "codes", "--wds", "png,txt", "--image_text_folder", shards, "--precompute_tokens"
    )
    tokens = os.path.join(tmp_path, "codes", "dalle", "tokens")
    assert len([f for f in os.listdir(tokens) if f.endswith(".tar")]) == 8
    a, b = _weights(images), _weights(codes)
    assert all(torch.equal(a[k], b[k]) for k in a)
    for later in step_dirs(os.path.join(tmp_path, "codes", "dalle", "checkpoints"))[:-2]:  # keep steps 0 and 4
        shutil.rmtree(later)
    train_dalle.main([*args, "--resume", "auto"])  # the tokens are kept, not encoded again
    c = _weights(codes)
    assert all(torch.equal(a[k], c[k]) for k in a)
    from_folder, _ = _dalle(vae_path, tmp_path / "folder", "--wds", "codes.npy,txt", "--image_text_folder", tokens)
    d = _weights(from_folder)
    assert all(torch.equal(a[k], d[k]) for k in a)


def test_codes_of_another_tokenizer_are_refused(shards, vae_path, tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "tokens")
    os.makedirs(out)
    with open(os.path.join(out, "encode.json"), "w") as f:
        json.dump({"vae_fingerprint": "another"}, f)
    with pytest.raises(SystemExit):
        _encode(shards, vae_path, out, 0, 1, monkeypatch, capsys)
    assert "holds the codes of another image tokenizer (fingerprint another" in capsys.readouterr().err
    with pytest.raises(ValueError, match="these codes were made by another image tokenizer"):
        encode.check_codes(out, "mine")


@pytest.mark.launcher
def test_the_command_under_torchrun_splits_the_shards_between_its_ranks(shards, vae_path, tmp_path):
    import subprocess
    import sys

    from helpers import ROOT

    out = str(tmp_path / "tokens")
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", "2", "--master_port",
           str(29900 + os.getpid() % 90), "-m", "dalle_pytorch.training.encode", "--shards", shards, "--wds", "png,txt",
           "--vae_path", vae_path, "--out", out]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0: encoded 4 shards" in done.stdout and "rank 1: encoded 4 shards" in done.stdout
    assert sorted(f for f in os.listdir(out) if f.endswith(".tar")) == [f"tokens-{i:06d}.tar" for i in range(8)]
