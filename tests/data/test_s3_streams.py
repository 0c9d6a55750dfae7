"""Shards in an S3-compatible store (a real SeaweedFS on 127.0.0.1, tests/s3_server.py), through fsspec: training
reads them into the shard cache, survives the server killed and restarted mid-epoch, resumes, and ends with the
weights it gets from the same files on disk; a wrong key, a missing bucket and a denied request are one line
each, without the secret."""

from __future__ import annotations

import glob
import json
import os
import threading
import time

import pytest
import torch
from s3_server import READER, s3_server  # noqa: F401  (the fixture)
from s3fs import S3FileSystem

from dalle_pytorch.data.shapes_export import export_wds
from dalle_pytorch.data.shard_index import read_index
from dalle_pytorch.files import safe_load
from dalle_pytorch.training.checkpoints import step_dirs

pytestmark = pytest.mark.e2e


def _shards(tmp_path, s3, bucket: str) -> str:
    """6 shards of 8 with img2dataset's _stats.json beside each (so counting reads 6 small files), uploaded."""
    folder = tmp_path / "shards"
    export_wds(str(folder), 48, image_size=16, per_shard=8)
    files = {}
    for name in sorted(os.listdir(folder)):
        files[name] = (folder / name).read_bytes()
        files[name.replace(".tar", "_stats.json")] = json.dumps({"successes": 8}).encode()
    s3.put(bucket, files)
    return f"s3://{bucket}/shard-{{000000..000005}}.tar"


def _args(tmp_path):
    from helpers import ONE_THREAD, TINY_VAE_MODEL

    return [
        *TINY_VAE_MODEL, *ONE_THREAD, "--wds", "png", "--batch_size", "4", "--num_workers", "2", "--steps", "12",
        "--quiet", "--sample_every", "0", "--save_every_n_steps", "4", "--keep_n_checkpoints", "5",
        "--resize_ratio", "0.8", "--shuffle_block", "16", "--shard_fetchers", "1",
        "--shard_cache", str(tmp_path / "cache"),
    ]  # fmt: skip


def _cached(folder) -> int:
    return len([n for n in os.listdir(folder) if n.endswith(".tar")]) if os.path.isdir(folder) else 0


def _weights(path):
    return safe_load(path)["weights"]


def test_training_on_s3_survives_a_restart_resumes_and_ends_with_the_local_weights(tmp_path, s3_server, monkeypatch):  # noqa: F811
    import shutil

    import train_vae

    pattern = _shards(tmp_path, s3_server, "train")
    args = _args(tmp_path)
    local = train_vae.main([*args, "--image_folder", str(tmp_path / "shards"), "--output_dir", str(tmp_path / "a")])
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    S3FileSystem.clear_instance_cache()
    cached = []

    def restart_mid_epoch():  # once the first block's shards are on disk: the server killed, back 2 s later
        while not _cached(tmp_path / "cache"):
            time.sleep(0.01)
        s3_server.kill()
        cached.append(_cached(tmp_path / "cache"))
        time.sleep(2)
        s3_server.start()

    restarter = threading.Thread(target=restart_mid_epoch, daemon=True)
    restarter.start()
    out = str(tmp_path / "b")
    export = train_vae.main(
        [*args, "--image_folder", pattern, "--output_dir", out, "--shards_index", "s3://train/index.json"]
    )
    restarter.join(timeout=60)
    assert cached and cached[0] < 6  # killed before every shard was fetched
    a = _weights(local)
    assert all(torch.equal(a[k], v) for k, v in _weights(export).items())
    assert read_index("s3://train/index.json") == {f"s3://train/shard-{i:06d}.tar": 8 for i in range(6)}

    for later in step_dirs(os.path.join(out, "vae", "checkpoints"))[:-2]:  # back to step 4: resumed from there
        shutil.rmtree(later)
    shutil.rmtree(tmp_path / "cache")
    resumed = train_vae.main([*args, "--image_folder", pattern, "--output_dir", out, "--resume", "auto",
                              "--shards_index", "s3://train/index.json"])  # fmt: skip
    assert all(torch.equal(a[k], v) for k, v in _weights(resumed).items())
    with open(os.path.join(out, "vae", "config.yaml")) as f:
        assert "testsecret" not in f.read()  # the credentials are never recorded


@pytest.mark.parametrize(
    "case, said",
    [
        ("wrong_key", "access denied (Forbidden): check the credentials"),
        ("missing_bucket", "no such object or bucket (The specified bucket does not exist)"),
        ("denied", "access denied (Forbidden): check the credentials"),
    ],
)
def test_store_errors_are_one_line_without_the_secret(tmp_path, s3_server, monkeypatch, capsys, case, said):  # noqa: F811
    import train_vae

    pattern = _shards(tmp_path, s3_server, "private")
    env = s3_server.env(READER) if case == "denied" else s3_server.env()
    if case == "wrong_key":
        env["AWS_SECRET_ACCESS_KEY"] = "not-the-secret"
    if case == "missing_bucket":
        pattern = pattern.replace("private", "nobucket")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    S3FileSystem.clear_instance_cache()  # a new process reads the environment; this one keeps fsspec's instances
    t = time.perf_counter()
    with pytest.raises(SystemExit):
        train_vae.main([*_args(tmp_path), "--image_folder", pattern, "--output_dir", str(tmp_path / "run"),
                        "--shard_retries", "1"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: 6 of 6 shards could not be read, more than --max_bad_shards 0; s3://")
    assert said in err[-1], err[-1]
    assert not any(env["AWS_SECRET_ACCESS_KEY"] in line for line in err)
    assert time.perf_counter() - t < 60  # final answers are not retried


def test_img2dataset_output_written_to_the_store_trains_as_is(tmp_path, s3_server, monkeypatch):  # noqa: F811
    """img2dataset 1.47 downloads images from a local nginx straight into s3://i2d/shards/ (its fsspec output);
    train_vae.py reads that folder URL as it is, counts the shards from their _stats.json, trains an epoch."""
    import csv
    import subprocess

    from http_shards import Nginx
    from PIL import Image
    from test_img2dataset import IMG2DATASET, IMG2DATASET_DIR

    import train_vae

    if not Nginx.available() or not os.path.exists(os.path.join(IMG2DATASET_DIR, ".installed")):
        pytest.skip("needs nginx and img2dataset (make install)")
    if not any(os.path.isdir(os.path.join(p, "s3fs")) for p in glob.glob(f"{IMG2DATASET_DIR}/lib/*/site-packages")):
        pytest.skip(f"img2dataset's venv {IMG2DATASET_DIR} has no s3fs: delete it and run `make install`")
    images = tmp_path / "images"
    images.mkdir()
    for i in range(40):
        Image.new("RGB", (48, 48), ((i * 37) % 256, (i * 91) % 256, 90)).save(images / f"{i:03d}.jpg")
    with open(tmp_path / "urls.csv", "w", newline="") as f, Nginx(str(images)) as nginx:
        csv.writer(f).writerows([["url", "caption"], *([nginx.url(f"{i:03d}.jpg"), f"colour {i}"] for i in range(40))])
        f.close()
        s3_server.put("i2d")
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        env.update(s3_server.env(), NO_ALBUMENTATIONS_UPDATE="1", WANDB_MODE="disabled", no_proxy="127.0.0.1")
        cmd = [
            IMG2DATASET, "--url_list", str(tmp_path / "urls.csv"), "--input_format", "csv", "--url_col", "url",
            "--caption_col", "caption", "--output_format", "webdataset", "--image_size", "16",
            "--processes_count", "1", "--thread_count", "4", "--number_sample_per_shard", "16",
            "--enable_wandb", "False", "--output_folder", "s3://i2d/shards",
        ]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    S3FileSystem.clear_instance_cache()
    from helpers import ONE_THREAD, TINY_VAE_MODEL

    out = tmp_path / "run"
    train_vae.main([*TINY_VAE_MODEL, *ONE_THREAD, "--wds", "jpg", "--image_folder", "s3://i2d/shards/",
                    "--batch_size", "8", "--epochs", "1", "--num_workers", "0", "--log_every", "1", "--quiet",
                    "--sample_every", "0", "--save_every_n_steps", "0", "--output_dir", str(out)])  # fmt: skip
    with open(out / "vae" / "shards.json") as f:
        counted = json.load(f)["samples"]
    assert counted == {f"s3://i2d/shards/{i:05d}.tar": 16 if i < 2 else 8 for i in range(3)}
    rows = [json.loads(line) for line in open(out / "vae" / "metrics.jsonl")]
    assert len(rows) == 5  # 40 samples, batch 8: one epoch


def test_the_encode_command_and_validation_read_the_store(tmp_path, s3_server, monkeypatch):  # noqa: F811
    """`python -m dalle_pytorch.training.encode --shards s3://...` writes the token shards it writes from the same
    files on disk, into a folder or into the store (--out s3://..., where DALLE trains on them), and
    --val_image_folder s3://... validates from the store."""
    from helpers import ONE_THREAD, TINY_DALLE_MODEL, TINY_VAE_MODEL

    import train_dalle
    import train_vae
    from dalle_pytorch.data.shards import open_shard
    from dalle_pytorch.training import encode

    pattern = _shards(tmp_path, s3_server, "enc")
    common = [*TINY_VAE_MODEL, *ONE_THREAD, "--batch_size", "8", "--num_workers", "0", "--quiet", "--sample_every", "0"]
    vae = train_vae.main([*common, "--steps", "2", "--dataset_size", "32", "--output_dir", str(tmp_path / "vae")])
    encode.main(
        ["--shards", str(tmp_path / "shards"), "--wds", "png,txt", "--vae_path", vae, "--out", str(tmp_path / "a")]
    )
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    S3FileSystem.clear_instance_cache()
    encode.main(["--shards", pattern, "--wds", "png,txt", "--vae_path", vae, "--out", str(tmp_path / "b")])
    s3_server.put("tokens")
    encode.main(["--shards", pattern, "--wds", "png,txt", "--vae_path", vae, "--out", "s3://tokens/run/"])
    for i in range(6):
        name = f"tokens-{i:06d}.tar"
        a, b, c = (
            open_shard(u) for u in (str(tmp_path / "a" / name), str(tmp_path / "b" / name), f"s3://tokens/run/{name}")
        )
        assert len(a) == len(b) == len(c) == 8 and all(a.read(j) == b.read(j) == c.read(j) for j in range(8))
    stored = s3_server.fs().ls("tokens/run")
    assert sum(n.endswith("_stats.json") for n in stored) == 6 and not [n for n in stored if ".tmp" in n], stored
    train_dalle.main([*TINY_DALLE_MODEL, *ONE_THREAD, "--vae_path", vae, "--wds", "codes.npy,txt",
                      "--image_text_folder", "s3://tokens/run/", "--batch_size", "4", "--num_workers", "0",
                      "--steps", "1", "--quiet", "--sample_every", "0",
                      "--output_dir", str(tmp_path / "dalle")])  # fmt: skip
    val = pattern.replace("000005", "000001")
    out = tmp_path / "run"
    train_vae.main([*common, "--wds", "png", "--image_folder", pattern, "--val_image_folder", val, "--val_every", "2",
                    "--steps", "2", "--log_every", "1", "--output_dir", str(out)])  # fmt: skip
    rows = [json.loads(line) for line in open(out / "vae" / "metrics.jsonl")]
    assert any("val_loss" in r for r in rows), rows[-1].keys()
