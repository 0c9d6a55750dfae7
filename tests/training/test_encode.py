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


@pytest.mark.e2e
def test_cached_caption_features_train_as_features_computed_on_the_fly(shards, vae_path, tmp_path, monkeypatch, capsys):
    """The encode command with --text_encoder stores every caption line's T5 features (real tokens, float16);
    training on them (`--wds codes.npy,feats.npz`, no encoder run per step) ends with the weights of the same run
    whose encoder reads the text on the fly, within the house tolerance (the encoder's batches differ: summation
    order under fp16 rounding)."""
    from launch import assert_same
    from text_encoders import tiny_t5

    from dalle_pytorch.data.encoder_tokenizer import EncoderTokenizer
    from dalle_pytorch.data.shards import open_shard
    from dalle_pytorch.inference.text_encoders import FrozenTextEncoder

    t5 = tiny_t5(str(tmp_path / "t5"))
    out = str(tmp_path / "tokens")
    for k, v in {"RANK": 0, "WORLD_SIZE": 1, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 1}.items():
        monkeypatch.setenv(k, str(v))
    args = ["--shards", shards, "--wds", "png,txt", "--vae_path", vae_path, "--out", out]
    assert encode.main([*args, "--text_encoder", "t5", "--text_encoder_path", t5, "--text_seq_len", "48"]) == 0
    meta = json.load(open(os.path.join(out, "encode.json")))
    assert meta["text_encoder"]["path"] == t5 and meta["text_feature_dim"] == 32
    shard = open_shard(os.path.join(out, "tokens-000000.tar"))
    sample = shard.read(0)
    assert sorted(sample) == ["__key__", "codes.npy", "feats.npz", "txt"]
    import io

    import numpy as np

    z = np.load(io.BytesIO(sample["feats.npz"]))
    lines = sample["txt"].decode().split("\n")
    encoder = FrozenTextEncoder(EncoderTokenizer("t5", t5))
    ids, _ = encoder.tokenizer.tokenize(lines, 48)
    assert z["lengths"].tolist() == (ids > 0).sum(1).tolist() and z["features"].dtype == np.float16
    torch.testing.assert_close(
        torch.from_numpy(z["features"][: z["lengths"][0]]), encoder.features(ids)[0, : z["lengths"][0]]
    )

    common = ["--image_text_folder", out, "--text_encoder", "t5", "--text_encoder_path", t5, "--text_seq_len", "48"]
    on_the_fly, _ = _dalle(vae_path, tmp_path / "a", "--wds", "codes.npy,txt", *common)
    cached, _ = _dalle(vae_path, tmp_path / "b", "--wds", "codes.npy,feats.npz", *common)
    assert_same(_weights(on_the_fly), _weights(cached))
    # --precompute_tokens with --wds caches the features with the codes, and trains on them as well
    pre, _ = _dalle(vae_path, tmp_path / "e", "--wds", "png,txt", "--precompute_tokens", "--image_text_folder", shards,
                    *common[2:])  # fmt: skip
    assert "feats.npz" in open_shard(str(tmp_path / "e" / "dalle" / "tokens" / "tokens-000000.tar")).read(0)
    assert_same(_weights(on_the_fly), _weights(pre))
    with pytest.raises(SystemExit):  # cached features without their encoder: one line
        _dalle(vae_path, tmp_path / "c", "--wds", "codes.npy,feats.npz", "--image_text_folder", out)
    with pytest.raises(SystemExit):  # the features of another encoder
        other = tiny_t5(str(tmp_path / "other"), seed=1)
        _dalle(vae_path, tmp_path / "d", "--wds", "codes.npy,feats.npz", *common[:3], other, *common[4:])


def test_cached_features_pick_the_caption_line_a_text_caption_picks():
    """A sample's cached features hold every caption line; the one read is the line rng.choice picks from the
    text for the same seed, so cached and on-the-fly runs read the same captions."""
    import io
    import random

    import numpy as np

    from dalle_pytorch.data.samples import FEATURES_KEY, caption_features

    lengths = np.array([2, 3, 1, 4], dtype=np.int32)
    feats = np.repeat(np.arange(4, dtype=np.float16), lengths)[:, None].repeat(5, 1)  # line i's rows hold i
    buf = io.BytesIO()
    np.savez(buf, lengths=lengths, features=feats)
    sample = {"__key__": "k", FEATURES_KEY: buf.getvalue()}
    for seed in range(20):
        line = random.Random(f"0/0/{seed}/1").choice(range(4))
        got = caption_features(sample, FEATURES_KEY, random.Random(f"0/0/{seed}/1"))
        assert got.shape == (lengths[line], 5) and (got == line).all()
