"""docs/llamagen.md's commands, run as written at tiny sizes: LlamaGen's files (tests/llamagen_files.py, small) and a
tiny T5 put into a Hugging Face cache under the names the doc downloads (FoundationVision/LlamaGen,
google/flan-t5-xl), HF_HUB_OFFLINE=1, and only sizes substituted (8 GPUs -> 2 ranks, 20000 steps -> 2, 256 px -> 16,
ViT-L-14's weights -> a random ViT-B-32's file, Inception's and VGG-16's -> random ones). `hf download` is what the
cache stands for; the push, offline, must say so in one line and leave the folder, which then loads by name."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

import llamagen_files as files
import pytest
import torch
from helpers import ROOT
from test_hub import put_in_cache
from text_encoders import tiny_t5

from dalle_pytorch.data.shapes_export import export_folder, export_wds

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # ~2 min: every step of the doc, 2 ranks included
DOC = os.path.join(ROOT, "docs", "llamagen.md")


def doc_commands() -> list[str]:
    """The doc's bash blocks, one command per (continued) line."""
    text = open(DOC).read()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [c.strip() for b in blocks for c in b.replace("\\\n", " ").splitlines() if c.strip()]


def sized(command: str, clip: str, inception: str, vgg16: str) -> list[str]:
    """The command at this machine's sizes, as argv."""
    swaps = {
        "--nproc_per_node 8": "--nproc_per_node 2",
        "{000000..000099}": "{000000..000001}",
        "--wds jpg,txt": "--wds png,txt",
        "--batch_size 32": "--batch_size 4",
        "--steps 20000": "--steps 2",
        "--num_images 5000": "--num_images 10",
        "ViT-L-14:openai": f"ViT-B-32:{clip}",
        "--vae_path FoundationVision/LlamaGen/vq_ds16_t2i.pt": (
            "--vae_path FoundationVision/LlamaGen/vq_ds16_t2i.pt --pretrained_image_size 16"
        ),
    }
    for a, b in swaps.items():
        command = command.replace(a, b)
    argv = shlex.split(command)
    if argv[0] == "python" and argv[1].endswith(".py"):
        argv = [sys.executable, os.path.join(ROOT, argv[1]), *argv[2:]]
    elif argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    elif argv[0] == "torchrun":
        argv = [os.path.join(os.path.dirname(sys.executable), "torchrun"), *argv[1:3], os.path.join(ROOT, argv[3]),
                *argv[4:], "--num_workers", "0", "--threads", "1", "--quiet"]  # fmt: skip
    if "dalle_pytorch.eval" in command:
        argv += ["--inception_weights", inception, "--vgg16_weights", vgg16]
    return argv


def test_the_llamagen_doc_runs_as_written(tmp_path, inception, vgg16):
    cache = str(tmp_path / "hf")
    repo = tmp_path / "repo"
    repo.mkdir()
    torch.save({"model": files.vq_state_dict("small"), "steps": 0}, repo / "vq_ds16_t2i.pt")
    torch.save({"model": files.gpt_state_dict("small"), "steps": 0}, repo / "t2i_XL_stage1_256.pt")
    put_in_cache(cache, "FoundationVision/LlamaGen", str(repo))
    t5 = tiny_t5(str(tmp_path / "t5"), d_model=files.GPT["small"]["caption_dim"])
    put_in_cache(cache, "google/flan-t5-xl", t5)
    torch.manual_seed(0)
    import open_clip

    clip = str(tmp_path / "vit_b_32.bin")
    torch.save(open_clip.create_model("ViT-B-32").state_dict(), clip)
    work = tmp_path / "work"
    for i, shard in enumerate(export_wds(str(work / "data"), 16, image_size=16, per_shard=8)):
        os.rename(shard, work / "data" / f"{i:06d}.tar")
    export_folder(str(work / "val"), 12, image_size=16, seed=1)

    env = {**os.environ, "HF_HUB_CACHE": cache, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    ran = []
    for command in doc_commands():
        if command.startswith("hf download"):
            continue  # the cache above is what it leaves
        if "--dalle_path me/" in command:  # the pushed model, by name: the folder push left, as the Hub holds it
            put_in_cache(cache, "me/llamagen-t2i-xl-ft", str(work / "runs" / "dalle" / "hub"))
        argv = sized(command, clip, inception, vgg16)
        done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=600)
        if "dalle_pytorch.hub push" in command:  # no network here: one line, and the folder is written
            assert done.returncode == 2 and "hf upload" in done.stderr, done.stderr[-2000:]
        else:
            assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
        ran.append(argv[1] if argv[1] != "-m" else argv[2])
    assert len(ran) == 7, ran  # convert, generate, encode, torchrun, eval, push, generate by name
    assert len(list((work / "images" / "a_corgi_wearing_a_crown").glob("0*.png"))) == 4
    import json

    results = json.load(open(work / "eval" / "results.json"))["dalle"]
    assert results["clip"]["kind"] == "open_clip" and "fid" in results and "clip_score" in results
    shutil.rmtree(cache)
