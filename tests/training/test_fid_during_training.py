"""--val_fid_every: FID and KID during training, logged to the trackers; the reference images and their statistics
are computed once, kept in the run directory under a name made from their pixels, and reused by a resumed run."""

from __future__ import annotations

import json
import os
import re

import pytest
from helpers import ONE_THREAD, TINY_VAE_MODEL
from launch import dalle_args

import train_clip
import train_dalle
import train_vae

pytestmark = pytest.mark.e2e
FID = ["--val_every", "4", "--val_fraction", "0.2", "--val_fid_every", "2", "--val_fid_samples", "12"]


def fid_rows(run: str) -> list[tuple[int, float, float]]:
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    return [(r["step"], r["val_fid"], r["val_kid"]) for r in rows if "val_fid" in r]


CLIP = ["--dim_text", "32", "--dim_image", "32", "--dim_latent", "32", "--heads", "2", "--patch_size", "4"]
CLIP += [*ONE_THREAD, "--num_workers", "0", "--quiet", "--dataset_size", "64", "--steps", "2"]


def test_a_dalle_logs_fid_and_a_resumed_run_reuses_the_reference(vae_path, inception, tmp_path, capsys):
    args = dalle_args(vae_path, str(tmp_path), 8, steps=4, extra=[*FID, "--inception_weights", inception])
    export = train_dalle.main(args)
    run = os.path.join(tmp_path, "dalle")
    logged = fid_rows(run)
    assert [step for step, _, _ in logged] == [2, 4] and all(fid > 0 for _, fid, _ in logged), logged
    (reference,) = [d for d in os.listdir(os.path.join(run, "fid")) if d.startswith("reference-")]
    assert len(os.listdir(os.path.join(run, "fid", reference))) == 12
    cached = sorted(os.listdir(os.path.join(run, "fid", "cache")))
    assert cached and all(reference in name for name in cached), cached  # the reference's features, by its name
    stamps = {n: os.path.getmtime(os.path.join(run, "fid", "cache", n)) for n in cached}
    assert sorted(os.listdir(os.path.join(run, "fid"))) == ["cache", reference]  # each step's images removed

    # resumed with a CLIP that reads this run's captions: its score of the same images too
    clip = train_clip.main([*CLIP, "--dalle_path", export, "--output_dir", str(tmp_path / "clip")])
    train_dalle.main([*args, "--resume", "auto", "--steps", "6", "--val_clip_path", clip])
    log = open(os.path.join(run, "train.log")).read()
    assert re.search(rf"--val_fid_every: reusing the reference images and their statistics in \S+{reference}", log)
    assert [step for step, _, _ in fid_rows(run)] == [2, 4, 6]
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    scores = [(r["step"], r["val_clip_score"]) for r in rows if "val_clip_score" in r]
    assert [step for step, _ in scores] == [6] and 0 <= scores[0][1] <= 100, scores
    with pytest.raises(SystemExit):
        train_dalle.main([*dalle_args(vae_path, str(tmp_path / "b"), 8, steps=2), "--val_clip_path", clip])
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .endswith("--val_clip_path scores the images --val_fid_every makes: add --val_fid_every N")
    )
    assert {n: os.path.getmtime(os.path.join(run, "fid", "cache", n)) for n in cached} == stamps  # read, not redone


def test_a_vae_logs_its_reconstruction_fid(inception, tmp_path):
    args = [*TINY_VAE_MODEL, *ONE_THREAD, "--num_workers", "0", "--quiet", "--dataset_size", "100", "--steps", "2"]
    train_vae.main([*args, *FID, "--output_dir", str(tmp_path), "--inception_weights", inception])
    assert [step for step, _, _ in fid_rows(os.path.join(tmp_path, "vae"))] == [2]


def test_val_fid_every_without_what_it_needs_is_one_line(vae_path, inception, tmp_path, capsys):
    def fails(main, argv) -> str:
        with pytest.raises(SystemExit):
            main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        return err[0]

    base = dalle_args(vae_path, str(tmp_path), 8, steps=2, extra=["--inception_weights", inception])
    assert "--val_fid_every measures against validation images: set --val_every" in fails(
        train_dalle.main, [*base, "--val_fid_every", "2"]
    )
    assert "--val_fid_samples must be between 10 and the" in fails(
        train_dalle.main, [*base, *FID, "--val_fid_samples", "5000"]
    )
    dalle = train_dalle.main(base)
    assert "--val_fid_every: the clip model makes no images to measure" in fails(
        train_clip.main, [*CLIP, "--dalle_path", dalle, *FID, "--output_dir", str(tmp_path / "clip")]
    )


@pytest.mark.launcher
def test_under_torchrun_every_rank_generates_its_share(vae_path, inception, tmp_path):
    from launch import launch

    args = dalle_args(vae_path, str(tmp_path), 4, steps=4, extra=[*FID, "--inception_weights", inception])
    launch("torchrun", "train_dalle.py", args)
    run = os.path.join(tmp_path, "dalle")
    logged = fid_rows(run)
    assert [step for step, _, _ in logged] == [2, 4] and all(fid > 0 and kid == kid for _, fid, kid in logged), logged
    assert sorted(os.listdir(os.path.join(run, "fid")))[0] == "cache"
