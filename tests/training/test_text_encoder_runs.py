"""train_dalle.py with a frozen text encoder (--text_encoder t5|clip) end to end: Llama blocks, guidance, EMA,
accumulation, validation, resume, --precompute_tokens; the export records the encoder; generate.py, train_clip.py
and the evaluation load it, and another encoder is refused in one line."""

import json
import os
import shutil
import socket
import sys
import urllib.request

import pytest
import torch
from helpers import ONE_THREAD
from test_trainers import _weights, step_dirs, tiny_dalle
from text_encoders import tiny_clip, tiny_t5

import generate
import train_clip
import train_dalle

pytestmark = pytest.mark.e2e
LLAMA = ["--norm", "rmsnorm", "--ff", "swiglu", "--kv_heads", "1", "--ff_multiple_of", "16"]


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    return {
        "t5": tiny_t5(str(root / "t5")),
        "clip": tiny_clip(str(root / "clip")),
        "other": tiny_t5(str(root / "x"), 1),
    }


@pytest.fixture(scope="module")
def vae_path(tmp_path_factory):
    from test_trainers import TINY_VAE

    import train_vae

    return train_vae.main([*TINY_VAE, "--steps", "2", "--output_dir", str(tmp_path_factory.mktemp("vae"))])


def test_t5_run_resumes_exactly_generates_with_guidance_and_reranks(vae_path, encoders, tmp_path):
    args = [
        *tiny_dalle(vae_path), "--text_encoder", "t5", "--text_encoder_path", encoders["t5"], "--text_seq_len", "40",
        "--null_cond_prob", "0.3", *LLAMA, "--ema", "0.9", "--global_batch_size", "16", "--val_every", "3",
        "--val_batches", "1", "--steps", "6", "--save_every_n_steps", "3", "--keep_n_checkpoints", "5",
        "--output_dir", str(tmp_path), "--sample_every", "3",
    ]  # fmt: skip
    export = train_dalle.main(args)
    full = _weights(export)
    run = tmp_path / "dalle"
    shutil.rmtree(step_dirs(str(run / "checkpoints"))[0])  # as if the run died after step 3's checkpoint
    os.remove(export)
    other = [encoders["other"] if a == encoders["t5"] else a for a in args]
    for _ in range(2):  # resumed with another encoder: one line, nothing trained; the record kept for the next try
        with pytest.raises(SystemExit):
            train_dalle.main([*other, "--resume", "auto"])
    train_dalle.main([*args, "--resume", "auto"])
    resumed = _weights(export)
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert any("val_loss" in r for r in rows) and "text_loss" not in rows[-1]

    from dalle_pytorch.inference.export import load_export

    obj = load_export(export, "dalle")
    assert obj["config"]["text_feature_dim"] == 32 and obj["config"]["num_text_tokens"] == 0
    record = obj["tokenizer"]
    assert record["kind"] == "text_encoder" and record["path"] == encoders["t5"] and len(record["fingerprint"]) == 16
    assert "ema" in obj
    from dalle_pytorch.convert import convert

    converted = convert(step_dirs(str(run / "checkpoints"))[0], str(tmp_path / "converted.safetensors"))
    assert load_export(converted, "dalle")["tokenizer"] == record  # a checkpoint's export keeps the encoder too

    clip = train_clip.main(
        ["--dalle_path", export, "--dim_text", "32", "--dim_image", "32", "--dim_latent", "32", "--heads", "2",
         "--patch_size", "4", *ONE_THREAD, "--num_workers", "0", "--quiet", "--dataset_size", "32", "--steps", "2",
         "--batch_size", "8", "--output_dir", str(tmp_path / "clip")]
    )  # fmt: skip
    out = tmp_path / "images"
    gen = ["--dalle_path", export, "--text", "a red circle|a blue square", "--num_images", "4", "--cond_scale", "3"]
    generate.main([*gen, "--clip_path", clip, "--keep", "2", "--outputs_dir", str(out)])
    assert len(list((out / "a_red_circle").glob("0*.png"))) == 2
    with pytest.raises(SystemExit) as e:  # a different encoder where the DALLE's was: one line, never garbage
        generate.main([*gen, "--text_encoder_path", encoders["other"], "--outputs_dir", str(tmp_path / "x")])
    assert e.value.code == 2

    from dalle_pytorch.eval import evaluate

    results = evaluate.main(["--dalle_path", export, "--num_images", "4", "--out", str(tmp_path / "eval")])
    assert results["dalle"]["heldout"]["n"] == 4 and results["dalle"]["bits_per_image_token"] > 0  # parsed, scored

    from helpers import ROOT, ServerProcess

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    serve = [sys.executable, os.path.join(ROOT, "serve.py"), "--dalle_path", export, "--port", str(port)]
    server = ServerProcess(serve, str(tmp_path / "serve.log"), f"http://127.0.0.1:{port}/health", env=env)
    try:
        body = json.dumps({"text": "a red circle", "num_images": 2, "seed": 3}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=body,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=120) as r:
            assert r.status == 200 and len(json.loads(r.read())["images"]) == 2
    finally:
        server.stop()


def test_clip_text_tower_with_precomputed_tokens_and_fine_tuning(vae_path, encoders, tmp_path):
    args = [*tiny_dalle(vae_path), "--text_encoder", "clip", "--text_encoder_path", encoders["clip"],
            "--text_seq_len", "24", "--precompute_tokens", "--steps", "2", "--sample_every", "0"]  # fmt: skip
    export = train_dalle.main([*args, "--output_dir", str(tmp_path / "a"), "--save_every_n_steps", "1"])
    shutil.rmtree(step_dirs(str(tmp_path / "a" / "dalle" / "checkpoints"))[0])  # died after step 1's checkpoint
    full = _weights(export)
    train_dalle.main([*args, "--output_dir", str(tmp_path / "a"), "--save_every_n_steps", "1", "--resume", "auto"])
    assert all(torch.equal(full[k], v) for k, v in _weights(export).items())
    moved = shutil.copytree(encoders["clip"], tmp_path / "moved")  # the encoder lives elsewhere on this machine
    tuned = train_dalle.main(
        ["--dalle_path", export, "--text_encoder_path", str(moved), *ONE_THREAD, "--batch_size", "8", "--quiet",
         "--num_workers", "0", "--dataset_size", "64", "--steps", "2", "--output_dir", str(tmp_path / "b")]
    )  # fmt: skip
    generate.main(
        ["--dalle_path", tuned, "--text", "a red circle", "--num_images", "2", "--outputs_dir", str(tmp_path / "i"),
         "--text_encoder_path", str(moved)]
    )  # fmt: skip
    assert len(list((tmp_path / "i" / "a_red_circle").glob("0*.png"))) == 2
