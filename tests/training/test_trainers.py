"""The trainers end to end on one process: run directory, resume, checkpoint safety, user errors."""

import glob
import json
import math
import os
import pickle
import re

import pytest
import torch
from helpers import ONE_THREAD, TINY_DALLE_MODEL, TINY_VAE_MODEL

import train_dalle
import train_vae
from dalle_pytorch.files import safe_load
from dalle_pytorch.training.checkpoints import step_dirs
from dalle_pytorch.training.loop import ShardedSampler

TINY_VAE = [
    *TINY_VAE_MODEL,
    *ONE_THREAD,
    "--batch_size",
    "8",
    "--num_workers",
    "0",
    "--quiet",
    "--dataset_size",
    "200",
    "--log_every",
    "2",
]


def tiny_dalle(vae_path):
    return [
        "--vae_path",
        vae_path,
        *TINY_DALLE_MODEL,
        *ONE_THREAD,
        "--batch_size",
        "8",
        "--num_workers",
        "0",
        "--quiet",
        "--dataset_size",
        "200",
        "--log_every",
        "2",
        "--sample_captions",
        "a red circle",
        "a blue square",
    ]


@pytest.fixture(scope="module")
def vae_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("vae")
    return train_vae.main([*TINY_VAE, "--steps", "4", "--output_dir", str(out), "--sample_every", "2"])


@pytest.mark.e2e
def test_vae_run_directory(vae_path):
    run = os.path.dirname(vae_path)
    for name in ("config.json", "metrics.jsonl", "train.log", "vae.safetensors", "config.yaml"):
        assert os.path.exists(os.path.join(run, name)), name
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [2, 4]
    assert {
        "loss",
        "lr",
        "grad_norm",
        "loss_scale",
        "temperature",
        "codebook_usage",
        "images_per_s",
        "tokens_per_s",
        "rank0/peak_memory_mb",
        "rank0/step_ms",
    } <= set(rows[-1])
    cfg = json.load(open(os.path.join(run, "config.json")))
    assert cfg["derived"]["global_batch_size"] == 8 and cfg["model"]["image_size"] == 16
    from PIL import Image

    grid = Image.open(os.path.join(run, "samples", "step-00000002.png"))
    grid.verify()
    # originals, hard and soft reconstructions: 3 rows of 8 images of 16 px with 1 px padding
    assert Image.open(os.path.join(run, "samples", "step-00000002.png")).size == (8 * 17 + 1, 3 * 17 + 1)
    assert step_dirs(os.path.join(run, "checkpoints"))


def _weights(path):
    return safe_load(path)["weights"]


def _metrics(run):
    return [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]


# One fixed batch (--dataset_size = --batch_size: every epoch is the same 8 samples), a constant learning rate
# and no warmup: a model, loss and optimizer that are wired right memorize it in a few dozen steps.
ONE_BATCH = [
    "--dataset_size",
    "8",
    "--batch_size",
    "8",
    "--log_every",
    "1",
    "--warmup_steps",
    "0",
    "--lr_decay",
    "constant",
    "--sample_every",
    "0",
    "--save_every_n_steps",
    "0",
]


@pytest.mark.e2e
def test_dalle_overfits_one_batch(vae_path, tmp_path):
    train_dalle.main(
        [*tiny_dalle(vae_path), *ONE_BATCH, "--steps", "25", "--learning_rate", "1e-2", "--output_dir", str(tmp_path)]
    )
    rows = _metrics(os.path.join(tmp_path, "dalle"))
    first, last = rows[0], rows[-1]
    assert len(rows) == 25 and last["lr"] == pytest.approx(1e-2)
    # measured: image loss 2.9 -> < 1e-3 (ln 16 = 2.8 is chance), text loss 5.6 -> 1.5
    assert last["image_loss"] < 0.1 * first["image_loss"], (first, last)
    assert last["text_loss"] < 0.5 * first["text_loss"], (first, last)


@pytest.mark.e2e
def test_vae_overfits_one_batch(tmp_path):
    train_vae.main([*TINY_VAE, *ONE_BATCH, "--steps", "60", "--learning_rate", "3e-3", "--output_dir", str(tmp_path)])
    rows = _metrics(os.path.join(tmp_path, "vae"))
    first, last = rows[0], rows[-1]
    # measured: reconstruction 0.74 -> 0.14 (16 codes of 16 dimensions bound it), PSNR 7 -> 14 dB
    assert last["recon"] < 0.3 * first["recon"], (first, last)
    assert last["psnr"] > first["psnr"] + 4, (first, last)


@pytest.mark.e2e
def test_dalle_resume_equals_uninterrupted(vae_path, tmp_path):
    args = [
        *tiny_dalle(vae_path),
        "--steps",
        "6",
        "--save_every_n_steps",
        "3",
        "--keep_n_checkpoints",
        "5",
        "--output_dir",
        str(tmp_path),
        "--sample_every",
        "3",
    ]
    export = train_dalle.main(args)
    full = _weights(export)
    ckpts = os.path.join(tmp_path, "dalle", "checkpoints")
    newest = step_dirs(ckpts)[0]
    assert newest.endswith("step-00000006")
    import shutil

    shutil.rmtree(newest)  # as if the run died after step 3's checkpoint
    os.remove(export)
    train_dalle.main([*args, "--resume", "auto"])
    resumed = _weights(export)
    for k in full:
        assert torch.equal(full[k], resumed[k]), k


@pytest.mark.e2e
def test_streamed_dalle_resume_equals_uninterrupted(vae_path, tmp_path):
    """Shards streamed by 2 DataLoader workers with random crops, resumed after step 3 (mid-epoch, on worker 1's
    turn, mid-shard) and run into the next epoch: the uninterrupted run's weights, bit for bit."""
    import shutil

    from dalle_pytorch.data.shapes_export import export_wds

    export_wds(str(tmp_path / "shards"), 70, image_size=16, per_shard=9)  # 8 shards, the last of 7
    args = [
        *tiny_dalle(vae_path), "--wds", "png,txt", "--image_text_folder", str(tmp_path / "shards"),
        "--num_workers", "2", "--resize_ratio", "0.75", "--steps", "10", "--save_every_n_steps", "3",
        "--keep_n_checkpoints", "5", "--output_dir", str(tmp_path), "--sample_every", "0",
    ]  # fmt: skip
    export = train_dalle.main(args)
    full = _weights(export)
    ckpts = os.path.join(tmp_path, "dalle", "checkpoints")
    for later in step_dirs(ckpts)[:-2]:  # keep steps 0 and 3
        shutil.rmtree(later)
    train_dalle.main([*args, "--resume", "auto"])
    resumed = _weights(export)
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    with open(os.path.join(tmp_path, "dalle", "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert rows[-1]["epoch"] == 1 and rows[-1]["skipped_bad_image"] == 0 and 0 <= rows[-1]["data_wait_share"] < 1


@pytest.mark.e2e
@pytest.mark.parametrize(
    "case, found",
    [
        ("truncated", "is truncated at byte"),
        ("empty", "holds no samples (an empty tar)"),
        ("not_utf8", "the txt caption is not UTF-8"),
        ("no_answer", "is unreadable: cannot connect"),
        ("wrong_key", "no png, the keys seen were jpg, txt: name them with --wds"),
    ],
)
def test_bad_shards_end_in_one_line_after_saying_what_they_found(vae_path, tmp_path, capfd, recwarn, case, found):
    """A new user's bad data, each case alone: what was found is said first (the shard or URL and why), then
    one last line (shards that cannot be read at all: why, in that line)."""
    import io
    import tarfile

    from PIL import Image

    path = tmp_path / "shard-0000.tar"
    with tarfile.open(path, "w") as tar:
        for i in range(8):
            buf = io.BytesIO()
            Image.new("RGB", (16, 16), (i * 30, 0, 0)).save(buf, format="PNG")
            ext = "jpg" if case == "wrong_key" else "png"
            caption = b"\xff\xfe a red square" if case == "not_utf8" else b"a red square"
            for name, data in ((f"{i:04d}.{ext}", buf.getvalue()), (f"{i:04d}.txt", caption)):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    if case == "truncated":
        path.write_bytes(path.read_bytes()[:700])
    if case == "empty":
        with tarfile.open(path, "w"):
            pass
    urls = "http://127.0.0.1:9/shard-{0000..0001}.tar" if case == "no_answer" else str(path)
    with pytest.raises(SystemExit):
        train_dalle.main(
            [*tiny_dalle(vae_path), "--wds", "png,txt", "--image_text_folder", urls, "--steps", "2",
             "--shard_retries", "1", "--output_dir", str(tmp_path), "--sample_every", "0"]
        )  # fmt: skip
    out, err = capfd.readouterr()
    assert found in out + err + "".join(str(w.message) for w in recwarn)  # warnings go to stderr outside pytest
    last = err.strip().splitlines()[-1]
    if case == "no_answer":  # no shard readable at all (a host, a bucket, a key): the line says why
        assert last.startswith("error: 2 of 2 shards could not be read, more than --max_bad_shards 0; http://")
        assert "cannot connect" in last
    else:
        assert last.startswith("error: the data yielded no batch: check the dataset and --batch_size")


@pytest.mark.e2e
def test_validation_samples_from_shards(vae_path, tmp_path):
    """--val_image_text_folder with --wds: shard URLs too, their first samples held in memory and read every
    --val_every steps."""
    from dalle_pytorch.data.shapes_export import export_wds

    export_wds(str(tmp_path / "shards"), 32, image_size=16, per_shard=8)
    export_wds(str(tmp_path / "val"), 20, image_size=16, per_shard=10, seed=1)
    train_dalle.main(
        [*tiny_dalle(vae_path), "--wds", "png,txt", "--image_text_folder", str(tmp_path / "shards"), "--steps", "4",
         "--val_every", "2", "--val_batches", "2", "--batch_size", "4", "--val_image_text_folder",
         str(tmp_path / "val" / "shard-{000000..000001}.tar"), "--output_dir", str(tmp_path), "--sample_every", "0"]
    )  # fmt: skip
    with open(os.path.join(tmp_path, "dalle", "metrics.jsonl")) as f:
        losses = [row["val_loss"] for row in map(json.loads, f) if "val_loss" in row]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)


@pytest.mark.e2e
def test_vae_resume_bitwise_with_gumbel_noise(tmp_path):
    args = [
        *TINY_VAE,
        "--steps",
        "4",
        "--save_every_n_steps",
        "2",
        "--keep_n_checkpoints",
        "5",
        "--output_dir",
        str(tmp_path),
        "--sample_every",
        "0",
    ]
    export = train_vae.main(args)
    full = _weights(export)
    import shutil

    shutil.rmtree(step_dirs(os.path.join(tmp_path, "vae", "checkpoints"))[0])
    train_vae.main([*args, "--resume", "auto"])
    resumed = _weights(export)
    assert all(torch.equal(full[k], resumed[k]) for k in full)


@pytest.mark.e2e
def test_auto_resume_skips_partial_and_corrupt(vae_path, tmp_path, capsys):
    args = [
        *tiny_dalle(vae_path),
        "--steps",
        "4",
        "--save_every_n_steps",
        "2",
        "--keep_n_checkpoints",
        "5",
        "--output_dir",
        str(tmp_path),
        "--sample_every",
        "0",
    ]
    train_dalle.main(args)
    ckpts = os.path.join(tmp_path, "dalle", "checkpoints")
    os.makedirs(os.path.join(ckpts, "step-00000009.tmp"))  # a write killed midway: never picked
    newest = step_dirs(ckpts)[0]
    with open(os.path.join(newest, "states.pt"), "r+b") as f:  # truncated by a crash or a full disk
        f.truncate(100)
    train_dalle.main([*args, "--resume", "auto", "--steps", "4"])
    out = capsys.readouterr().out
    assert "skipping checkpoint" in out and "truncated or corrupted" in out
    assert "resumed from" in out and "step-00000002" in out


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/dalle_pwned",))


def test_malicious_pickle_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"weights": Evil()}, path, pickle_module=pickle)
    with pytest.raises(ValueError, match="refusing to load"):
        safe_load(str(path))
    assert not os.path.exists("/tmp/dalle_pwned")


@pytest.mark.e2e
def test_user_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_vae.main([*TINY_VAE, "--image_folder", str(tmp_path), "--output_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert "no images under" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        train_dalle.main(["--output_dir", str(tmp_path)])
    assert "--vae_path is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_vae.main([*TINY_VAE, "--global_batch_size", "12", "--output_dir", str(tmp_path)])
    assert "not a multiple" in capsys.readouterr().err


@pytest.mark.e2e
def test_accumulation_equals_large_batch(vae_path, tmp_path):
    common = [*tiny_dalle(vae_path), "--steps", "3", "--save_every_n_steps", "0", "--sample_every", "0"]
    big = train_dalle.main([*common, "--batch_size", "8", "--output_dir", str(tmp_path / "a")])
    acc = train_dalle.main(
        [*common, "--batch_size", "4", "--global_batch_size", "8", "--output_dir", str(tmp_path / "b")]
    )
    a, b = _weights(big), _weights(acc)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


@pytest.mark.e2e
def test_train_dalle_on_webdataset_shards(vae_path, tmp_path):
    from dalle_pytorch.data.shapes_export import export_wds

    export_wds(str(tmp_path / "shards"), 64, image_size=16, per_shard=16)
    urls = str(tmp_path / "shards" / "shard-{000000..000003}.tar")
    export = train_dalle.main(
        [
            *tiny_dalle(vae_path),
            "--wds",
            "png,txt",
            "--image_text_folder",
            urls,
            "--steps",
            "3",
            "--output_dir",
            str(tmp_path),
            "--sample_every",
            "0",
            "--save_every_n_steps",
            "0",
        ]
    )
    assert os.path.exists(export)


@pytest.mark.e2e
def test_plot_draws_the_curves(vae_path):
    from PIL import Image

    from dalle_pytorch.eval.plot import plot

    out = plot(os.path.dirname(vae_path))
    with Image.open(out) as img:
        img.verify()
    with Image.open(out) as img:
        assert img.size == (1100, 400)


def test_plot_of_a_missing_run_is_a_clear_error(tmp_path, capsys):
    from dalle_pytorch.eval.plot import main

    with pytest.raises(SystemExit):
        main([str(tmp_path)])
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


@pytest.mark.e2e
def test_train_vae_on_webdataset_shards(tmp_path):
    from dalle_pytorch.data.shapes_export import export_wds

    export_wds(str(tmp_path / "shards"), 32, image_size=16, per_shard=16)
    urls = str(tmp_path / "shards" / "shard-{000000..000001}.tar")
    export = train_vae.main(
        [
            *TINY_VAE,
            "--wds",
            "png",
            "--image_folder",
            urls,
            "--steps",
            "2",
            "--batch_size",
            "8",
            "--output_dir",
            str(tmp_path),
            "--sample_every",
            "0",
            "--save_every_n_steps",
            "0",
        ]
    )
    assert os.path.exists(export)


@pytest.mark.e2e
def test_resume_with_another_vae_is_refused(vae_path, tmp_path, capsys):
    args = [*tiny_dalle(vae_path), "--steps", "2", "--output_dir", str(tmp_path), "--sample_every", "0"]
    train_dalle.main(args)
    other = train_vae.main([*TINY_VAE, "--steps", "1", "--seed", "7", "--output_dir", str(tmp_path / "other")])
    with pytest.raises(SystemExit):
        train_dalle.main([*tiny_dalle(other), "--steps", "4", "--output_dir", str(tmp_path), "--resume", "auto"])
    assert "is not the VAE this run was trained with" in capsys.readouterr().err


@pytest.mark.e2e
def test_wandb_offline_logging(vae_path, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = [*TINY_VAE, "--output_dir", str(tmp_path), "--wandb", "--sample_every", "0", "--save_every_n_steps", "2"]
    train_vae.main([*args, "--steps", "2"])
    run_id = open(os.path.join(tmp_path, "vae", "wandb_run_id")).read()
    train_vae.main([*args, "--steps", "4", "--resume", "auto"])  # goes on in the same wandb run
    assert open(os.path.join(tmp_path, "vae", "wandb_run_id")).read() == run_id
    runs = glob.glob(os.path.join(tmp_path, "vae", "wandb", "offline-run-*"))
    # offline-run-TIME-ID, and -ID-1 for a second start within the same second: one wandb run (`wandb sync`)
    assert len(runs) == 2 and all(re.search(f"-{run_id}(-[0-9]+)?$", r) for r in runs), (run_id, runs)


@pytest.mark.e2e
def test_unknown_flag_value_is_one_line(capsys):
    with pytest.raises(SystemExit):
        train_vae.main(["--precision", "fp8"])
    err = capsys.readouterr().err
    assert "invalid choice: 'fp8'" in err and "Traceback" not in err


@pytest.mark.e2e
def test_out_of_disk_is_one_line(tmp_path, capsys, monkeypatch):
    import errno

    import dalle_pytorch.inference.export as export

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export, "atomic_save", full_disk)
    with pytest.raises(SystemExit):
        train_vae.main([*TINY_VAE, "--steps", "1", "--output_dir", str(tmp_path), "--save_every_n_steps", "0"])
    err = capsys.readouterr().err
    assert "out of disk space" in err and "Traceback" not in err


@pytest.mark.e2e
def test_precomputed_tokens_train_and_are_cached(vae_path, tmp_path, capsys):
    args = [
        *tiny_dalle(vae_path),
        "--steps",
        "2",
        "--output_dir",
        str(tmp_path),
        "--sample_every",
        "0",
        "--precompute_tokens",
    ]
    train_dalle.main(args)
    assert os.path.exists(os.path.join(tmp_path, "dalle", "tokens.pt"))
    assert "precomputed image tokens of 200 samples" in capsys.readouterr().out
    train_dalle.main([*args, "--steps", "3", "--resume", "auto"])
    assert "precomputed image tokens" not in capsys.readouterr().out  # reused


@pytest.mark.e2e
@pytest.mark.slow
def test_compile_flag_trains(vae_path, tmp_path):
    export = train_dalle.main([*tiny_dalle(vae_path), "--steps", "3", "--output_dir", str(tmp_path), "--compile"])
    assert set(safe_load(export)["weights"]) == set(_weights_keys(vae_path, tmp_path))


def _weights_keys(vae_path, tmp_path):
    export = train_dalle.main([*tiny_dalle(vae_path), "--steps", "1", "--output_dir", str(tmp_path / "plain")])
    return safe_load(export)["weights"].keys()


@pytest.mark.parametrize("new_world", [1, 2, 3])
def test_sampler_position_holds_at_any_world_size(new_world):
    """2 ranks consumed 3 batches each; resumed on 1, 2 or 3 ranks, no sample repeats within the epoch and
    the ranks get equal whole batches; on 2 ranks each continues exactly where it stopped."""
    length, batch = 101, 4
    first = [list(ShardedSampler(length, r, 2, 0, batch)) for r in range(2)]
    seen = {i for shard in first for i in shard[: 3 * batch]}
    rest = []
    for r in range(new_world):
        sampler = ShardedSampler(length, r, new_world, 0, batch)
        sampler.set_position(0, 3 * batch * 2)
        rest.append(list(sampler))
        assert len(sampler) == len(rest[-1])
    after = [i for shard in rest for i in shard]
    assert not seen & set(after) and len(set(after)) == len(after)
    assert len({len(shard) for shard in rest}) == 1 and len(rest[0]) % batch == 0 and len(rest[0]) > 0
    if new_world == 2:
        assert rest == [shard[3 * batch :] for shard in first]


SPARSE_ARGS = ["--attn_types", "full,axial_row,axial_col,conv_like,sparse", "--depth", "5"]


@pytest.mark.e2e
def test_sparse_patterns_train(vae_path, tmp_path):
    """The predecessor's comma-separated --attn_types, each pattern computed sparsely."""
    export = train_dalle.main([*tiny_dalle(vae_path), "--steps", "2", *SPARSE_ARGS, "--output_dir", str(tmp_path)])
    assert all(torch.isfinite(w).all() for w in safe_load(export)["weights"].values())


@pytest.mark.e2e
@pytest.mark.slow
def test_sparse_patterns_train_compiled_with_recomputation(vae_path, tmp_path):
    extra = ["--compile", "--checkpoint_activations", "--output_dir", str(tmp_path)]
    export = train_dalle.main([*tiny_dalle(vae_path), "--steps", "2", *SPARSE_ARGS, *extra])
    assert all(torch.isfinite(w).all() for w in safe_load(export)["weights"].values())


def test_validation_during_training_on_every_trainer(vae_path, tmp_path):
    """--val_every: the DALLE on held-out samples of the built-in data (and the parser on images generated for
    held-out captions), the VAE on --val_fraction of an image folder: val_* rows in metrics.jsonl at those steps."""
    from dalle_pytorch.data.shapes_export import export_folder

    val = ["--val_every", "2", "--val_batches", "1"]
    train_dalle.main([*tiny_dalle(vae_path), "--steps", "4", "--output_dir", str(tmp_path / "d"), *val])
    rows = [r for r in _metrics(tmp_path / "d" / "dalle") if "val_loss" in r]
    assert [r["step"] for r in rows] == [2, 4] and all(math.isfinite(r["val_loss"]) for r in rows)
    assert "val_loss_img" in rows[0] or any(k.startswith("val_") and k != "val_loss" for k in rows[0])
    # the built-in data: 16 held-out captions generated and parsed (tests/training/test_heldout_scores.py)
    assert all(0 <= r["val_heldout_full"] <= r["val_heldout_color"] <= 1 for r in rows)
    folder = str(tmp_path / "images")
    export_folder(folder, 40, 32, seed=3)
    frac = ["--val_fraction", "0.25", "--batch_size", "4"]
    train_vae.main(
        [*TINY_VAE, "--image_folder", folder, "--steps", "2", "--output_dir", str(tmp_path / "v"), *val, *frac]
    )
    assert [r["step"] for r in _metrics(tmp_path / "v" / "vae") if "val_loss" in r] == [2]


@pytest.mark.e2e
def test_quiet_prints_nothing_but_errors_and_guidance_without_dropout_is_said(vae_path, tmp_path, capfd):
    """--quiet: neither YouTokenToMe's BPE log (C++, on file descriptor 1) nor the per-rank table reach the
    console (the table is in train.log); --cond_scale on a DALLE trained without --null_cond_prob warns."""
    import generate

    args = [*tiny_dalle(vae_path), "--tokenizer", "yttm", "--steps", "2", "--output_dir", str(tmp_path)]
    export = train_dalle.main([*args, "--sample_every", "0"])
    out = capfd.readouterr().out
    assert "vocab" not in out.lower() and "per-rank summary" not in out, out
    assert "per-rank summary" in open(os.path.join(tmp_path, "dalle", "train.log")).read()
    generate.main(["--dalle_path", export, "--text", "a red circle", "--num_images", "1", "--cond_scale", "2",
                   "--outputs_dir", str(tmp_path / "out")])  # fmt: skip
    assert "--cond_scale 2 on a DALLE trained without --null_cond_prob" in capfd.readouterr().out
