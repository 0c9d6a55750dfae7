"""A real client's output, as it is: img2dataset 1.47 downloads 120 images (and 3 URLs that are gone) from an
nginx the test starts, into WebDataset shards (.jpg, .txt, .json, .parquet, NAME_stats.json), and train_vae.py
--wds jpg and train_dalle.py --wds jpg,txt / jpg,json stream those shards over HTTP for a whole epoch each.

img2dataset lives in a virtual environment of its own (its dependencies would move .venv's pins), which
`make install` makes in ~/.cache/dalle-pytorch/img2dataset-1.47 as an optional step; without it, these skip.
"""

from __future__ import annotations

import csv
import glob
import json
import os
import subprocess

import pytest
import torch
from helpers import ONE_THREAD, TINY_DALLE_MODEL, TINY_VAE_MODEL
from http_shards import Nginx

CACHE = os.environ.get("DALLE_CACHE") or os.path.expanduser("~/.cache/dalle-pytorch")
IMG2DATASET_DIR = os.path.join(CACHE, "img2dataset-1.47")  # a venv of its own, complete once .installed is there
IMG2DATASET = os.path.join(IMG2DATASET_DIR, "bin", "img2dataset")
IMAGES, GONE = 120, (10, 70, 110)  # rows of the URL list whose file the server does not have (HTTP 404)
BATCH = 8

pytestmark = [
    pytest.mark.e2e,  # img2dataset and three trainings: about 12 s in all
    pytest.mark.skipif(not Nginx.available(), reason="needs Debian's nginx (make install-cluster)"),
    pytest.mark.skipif(
        not os.path.exists(os.path.join(IMG2DATASET_DIR, ".installed")),
        reason=f"img2dataset 1.47 is not in {IMG2DATASET_DIR} (`make install` puts it there; its step is optional "
        "and warns when it fails)",
    ),
]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """img2dataset's output folder, made from a CSV of URLs on a local nginx: 123 rows, 120 images found."""
    from PIL import Image

    root = tmp_path_factory.mktemp("img2dataset")
    images = root / "images"
    images.mkdir()
    for i in range(IMAGES):  # flat colours, each its own: 64x64, resized by img2dataset to 32x32
        Image.new("RGB", (64, 64), ((i * 37) % 256, (i * 91) % 256, (i * 53) % 256)).save(images / f"{i:03d}.jpg")
    out = root / "shards"
    with Nginx(str(images)) as nginx:
        rows = [(f"{i:03d}.jpg", f"colour {i}") for i in range(IMAGES)]  # within --text_seq_len 12: none cut
        for row in GONE:
            rows.insert(row, (f"gone-{row}.jpg", "gone"))
        with open(root / "urls.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["url", "caption"])
            writer.writerows([nginx.url(name), caption] for name, caption in rows)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        # Nothing from outside: albumentations' update check and wandb stay off; the proxy is never asked
        env.update(NO_ALBUMENTATIONS_UPDATE="1", WANDB_MODE="disabled", NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")
        cmd = [
            IMG2DATASET, "--url_list", str(root / "urls.csv"), "--input_format", "csv", "--url_col", "url",
            "--caption_col", "caption", "--output_format", "webdataset", "--image_size", "32",
            "--processes_count", "1", "--thread_count", "4", "--number_sample_per_shard", "50",
            "--enable_wandb", "False", "--output_folder", str(out),
        ]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return out


def _stats(out) -> dict[str, dict]:
    return {os.path.basename(p)[: -len("_stats.json")]: json.load(open(p)) for p in glob.glob(f"{out}/*_stats.json")}


def test_img2dataset_writes_what_the_readers_assume(shards):
    """NAME.tar beside NAME_stats.json (its "successes" is what shard_index.py counts), one jpg, txt and json per
    sample, and the failures counted in the stats, not in the tar."""
    stats = _stats(shards)
    assert sorted(stats) == ["00000", "00001", "00002"]  # 123 rows, 50 per shard
    assert {f"{n}.{ext}" for n in stats for ext in ("tar", "parquet")} <= set(os.listdir(shards))
    assert sum(s["count"] for s in stats.values()) == IMAGES + len(GONE)
    assert sum(s["failed_to_download"] for s in stats.values()) == len(GONE)
    assert sum(s["successes"] for s in stats.values()) == IMAGES

    from dalle_pytorch.data.shard_index import _stats_count
    from dalle_pytorch.data.shards import open_shard

    for name, s in stats.items():
        shard = open_shard(str(shards / f"{name}.tar"))
        assert len(shard) == s["successes"] == _stats_count(str(shards / f"{name}.tar"))
        sample = shard.read(0)
        assert {"jpg", "txt", "json"} <= set(sample), sample.keys()
        assert json.loads(sample["json"])["caption"] == sample["txt"].decode()
        shard.close()


@pytest.fixture(scope="module")
def served(shards):
    with Nginx(str(shards)) as nginx:
        yield nginx


def _pattern(nginx: Nginx, shards) -> str:
    last = max(_stats(shards))
    return nginx.url(f"{{00000..{last}}}.tar").replace("%7B", "{").replace("%7D", "}")


def _check_run(run: str, nginx: Nginx, shards) -> None:
    """The run counted each shard from its stats (fetched beside it), and read every sample it planned."""
    with open(os.path.join(run, "shards.json")) as f:
        counted = json.load(f)["samples"]
    assert counted == {nginx.url(f"{name}.tar"): s["successes"] for name, s in _stats(shards).items()}
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert len(rows) == IMAGES // BATCH  # --log_every 1, one epoch
    skipped = {k: v for k, v in rows[-1].items() if k.startswith("skipped_")}
    assert skipped and not any(skipped.values()), skipped


COMMON = [
    *ONE_THREAD, "--batch_size", str(BATCH), "--num_workers", "0", "--epochs", "1", "--log_every", "1", "--quiet",
    "--sample_every", "0", "--save_every_n_steps", "0",
]  # fmt: skip


@pytest.fixture(scope="module")
def vae_path(served, shards, tmp_path_factory):
    import train_vae

    out = tmp_path_factory.mktemp("vae")
    return train_vae.main(
        [*TINY_VAE_MODEL, *COMMON, "--wds", "jpg", "--image_folder", _pattern(served, shards), "--output_dir", str(out)]
    )


def test_vae_trains_on_img2dataset_shards_over_http(vae_path, served, shards):
    assert os.path.exists(vae_path)
    _check_run(os.path.dirname(vae_path), served, shards)
    with open(os.path.join(served.prefix, "access.log")) as f:
        log = f.read()
    assert all(f"GET /{name}_stats.json " in log for name in _stats(shards))  # counted from the stats


def test_dalle_trains_on_img2dataset_shards_over_http_with_txt_or_json_captions(vae_path, served, shards, tmp_path):
    """--wds jpg,json reads the "caption" field of img2dataset's record: the same captions as jpg,txt, so the
    same weights."""
    import train_dalle
    from dalle_pytorch.files import safe_load

    weights = []
    for caption in ("txt", "json"):
        export = train_dalle.main(
            [*TINY_DALLE_MODEL, *COMMON, "--vae_path", vae_path, "--wds", f"jpg,{caption}",
             "--image_text_folder", _pattern(served, shards), "--output_dir", str(tmp_path / caption)]
        )  # fmt: skip
        assert os.path.exists(export)
        run = os.path.dirname(export)
        _check_run(run, served, shards)
        last = json.loads(open(os.path.join(run, "metrics.jsonl")).readlines()[-1])
        assert last["truncated_captions"] == 0
        weights.append(safe_load(export)["weights"])
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
