"""The commands of lucidrains' DALLE-pytorch 1.6.6 README, verbatim, on tiny shapes.

Each command's text is the README's; only its placeholder paths are replaced by files made here, and tiny
model and run sizes are appended (TINY). The pretrained tokenizers it downloads (OpenAI's dVAE when no VAE is
given, the VQGAN of a bare --taming) come from a local server (conftest.py) serving small ones, and the
VAE and DALLE files it names are ones the predecessor itself wrote (tests/fixtures/reference).

On a CPU, DeepSpeed refuses fp16 (its loss scaler is GPU-only), so each README command that combines
`--deepspeed` with `--fp16` or `--amp` is checked to map its flags and stop with that one line; the same
command without the precision flag then trains.
"""

from __future__ import annotations

import glob
import io
import json
import os
import re
import shlex
import shutil

import pytest
import torch
from helpers import ONE_THREAD, TESTS
from launch import launch

import generate
import train_dalle
import train_vae
from dalle_pytorch import convert
from dalle_pytorch.data.shapes_export import export_folder, sample
from dalle_pytorch.files import safe_load
from dalle_pytorch.inference.load import load_dalle

OLD = os.path.join(TESTS, "fixtures", "reference", "plain")  # vae.pt and dalle.pt written by dalle-pytorch 1.6.6
OLD_BPE = os.path.join(TESTS, "fixtures", "reference", "bpe.yttm")  # the tokenizer its dalle.pt was trained with


def tiny(script: str, out: str, args: list[str]) -> list[str]:
    run = ["--steps", "2", "--batch_size", "4", "--num_workers", "0", "--output_dir", out, "--sample_every", "0"]
    if script == "train_vae.py":
        return [*run, "--image_size", "16", "--num_tokens", "16", "--hidden_dim", "16", "--emb_dim", "16", *ONE_THREAD]
    if script == "train_dalle.py":
        model = ["--dim", "32", "--depth", "1", "--heads", "2", "--dim_head", "16", "--text_seq_len", "16"]
        if "--dalle_path" in args:  # its model is the file's
            return [*run, *ONE_THREAD]
        pretrained = "--vae_path" not in args  # 16-pixel images for the small tokenizers served
        return [*run, *model, *(["--pretrained_image_size", "16"] if pretrained else []), *ONE_THREAD]
    return ["--num_images", "2", "--batch_size", "2", "--outputs_dir", out, "--quiet"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """What the README's placeholders name: images, caption pairs, shards, a vae.pt and a dalle.pt."""
    root = tmp_path_factory.mktemp("predecessor")
    export_folder(str(root / "data"), 16, image_size=32)
    shards = root / "shards"
    os.makedirs(shards)
    for n in range(2):
        _write_shard(str(shards / f"part-{n}.tar"), ("img", "cap"), start=8 * n)
    _write_shard(str(root / "json.tar"), ("jpg", "json"), start=0)  # img2dataset's layout, served over http
    shutil.copy(os.path.join(OLD, "vae.pt"), root / "vae.pt")
    return {
        "/path/to/your/images": str(root / "data"),
        "./vae.pt": str(root / "vae.pt"),
        "/path/to/data.tar(.gz)": str(shards / "part-0.tar"),
        "/path/to/shardfolder": str(shards),
        "/path/to/coco/dataset": str(root / "data"),
        "/path/to/data": str(root / "data"),
        "./path/to/data": str(root / "data"),
        "./path/to/bpe.model": OLD_BPE,
        "'DatasetsDir'": str(root / "data"),
        "./dalle.pt": str(root / "dalle.pt"),  # written by the first DALLE command below
        "<json shard>": str(root / "json.tar"),
    }


def _write_shard(path: str, keys: tuple[str, str], start: int) -> None:
    import webdataset as wds

    with wds.TarWriter(path) as sink:
        for i in range(start, start + 8):
            img, caption, _ = sample(0, i, 32, "train")
            buf = io.BytesIO()
            img.save(buf, format="JPEG")
            text = json.dumps({"caption": caption}) if keys[1] == "json" else caption
            sink.write({"__key__": f"{i:06d}", keys[0]: buf.getvalue(), keys[1]: text.encode()})


def run(command: str, files: dict, out: str, extra=()):
    """The README command with its placeholders replaced, in this process (python) or under its launcher."""
    pattern = "|".join(re.escape(p) for p in sorted(files, key=len, reverse=True))  # one pass, longest first
    command = re.sub(pattern, lambda m: shlex.quote(files[m.group(0)]), command)
    launcher, *args = shlex.split(command.removeprefix("$ "))
    if launcher == "horovodrun":  # horovodrun -np N file.py ...: launch() starts 2 processes on this host
        args = args[2:]
    script, *args = args
    args = [*args, *tiny(script, out, args), *extra]
    if launcher == "python":
        return {"train_vae.py": train_vae, "train_dalle.py": train_dalle, "generate.py": generate}[script].main(args)
    return launch("deepspeed" if launcher == "deepspeed" else "horovod", script, args, timeout=400)


def test_train_the_vae(files, tmp_path, capsys):
    path = run("$ python train_vae.py --image_folder /path/to/your/images", files, str(tmp_path))
    assert os.path.exists(path)
    run("$ python train_vae.py --image_folder /path/to/your/images --transparent --kl_loss_weight 0.1", files,
        str(tmp_path))  # fmt: skip
    out = capsys.readouterr().out
    assert "predecessor flag --transparent: --channels 4" in out
    assert "predecessor flag --kl_loss_weight: --kl_div_loss_weight 1.6" in out  # 0.1 x 16 positions
    assert "predecessor flag --emb_dim: --codebook_dim 16" in out


def test_train_dalle_on_its_vae_then_generate(files, tmp_path, capsys):
    # the vae.pt the predecessor's train_vae.py wrote, read as it is
    path = run("$ python train_dalle.py --vae_path ./vae.pt --image_text_folder /path/to/data", files, str(tmp_path))
    assert "a dalle-pytorch 1.6 vae checkpoint, converted on the fly" in capsys.readouterr().out
    shutil.copy(path, files["./dalle.pt"])
    for command in (
        "$ python generate.py --dalle_path ./dalle.pt --text 'fireflies in a field under a full moon'",
        "$ python generate.py --dalle_path ./dalle.pt --text 'a dog chewing a bone|a cat chasing mice|a frog eating a fly'",  # noqa: E501
        "$ python generate.py --dalle_path ./dalle.pt --text 'a dog chewing a bone' --gentext",
    ):
        folders = run(command, files, str(tmp_path / "out"))
        assert all(os.path.exists(os.path.join(f, "0001.png")) for f in folders)
    assert len(folders) == 1 and "caption: a dog chewing a" in capsys.readouterr().out  # kept, then continued


@pytest.mark.e2e
def test_resume_from_its_dalle(files, tmp_path, capsys):
    """Its dalle.pt (the tokenizer it was trained with passed again, as its train_dalle.py needed too)."""
    old = os.path.join(str(tmp_path), "dalle.pt")
    shutil.copy(os.path.join(OLD, "dalle.pt"), old)
    path = run(f"$ python train_dalle.py --dalle_path {old} --image_text_folder /path/to/data", files, str(tmp_path),
               ["--bpe_path", OLD_BPE])  # fmt: skip
    dalle, vae, tokenizer = load_dalle(path)
    assert dalle.cfg.reference_layout and vae.image_size == 32 and tokenizer.vocab_size == 60
    assert f"started from {old}" in capsys.readouterr().out
    # a resume checkpoint of that run converts to the same export (its VAE and tokenizer come from the start file)
    step = sorted(glob.glob(os.path.join(str(tmp_path), "dalle", "checkpoints", "step-*")))[-1]
    convert.main([step, "--out", str(tmp_path / "converted.pt")])
    again = safe_load(str(tmp_path / "converted.pt"))
    export = safe_load(path)
    assert again["tokenizer"] == export["tokenizer"] and again["vae"]["config"] == export["vae"]["config"]
    assert all(torch.equal(again["weights"][k], w) for k, w in export["weights"].items())
    with pytest.raises(SystemExit):  # its model is the file's: a model flag is refused, by name
        run(f"$ python train_dalle.py --dalle_path {old} --image_text_folder /path/to/data", files, str(tmp_path),
            ["--bpe_path", OLD_BPE, "--dim", "64"])  # fmt: skip
    assert "--dalle_path fixes the model" in capsys.readouterr().err


def test_pretrained_tokenizers_are_downloaded(files, pretrained_server, tmp_path, capsys):
    for command in (
        "$ python train_dalle.py --image_text_folder /path/to/coco/dataset",  # OpenAI's dVAE
        "$ python train_dalle.py --image_text_folder /path/to/coco/dataset --taming",  # the VQGAN
        "$ python train_dalle.py --image_text_folder ./path/to/data --bpe_path ./path/to/bpe.model",
        "$ python train_dalle.py --wds img,cap --image_text_folder /path/to/data.tar(.gz)",
    ):
        assert os.path.exists(run(command, files, str(tmp_path)))
    assert "using OpenAI's pretrained dVAE" in capsys.readouterr().out
    names = [name for name, _ in pretrained_server.log]
    assert sorted(set(names)) == ["decoder.pkl", "encoder.pkl", "vqgan.1024.config.yml", "vqgan.1024.model.ckpt"]
    assert len(names) == 4  # each downloaded once


FP16_DEEPSPEED = [
    "$ deepspeed train_dalle.py --wds img,cap --image_text_folder /path/to/data.tar(.gz) --fp16 --deepspeed",
    "$ deepspeed train_dalle.py --wds img,cap --image_text_folder /path/to/shardfolder --fp16 --deepspeed",
    '$ deepspeed train_dalle.py --image_text_folder "http://storage.googleapis.com/nvdata-openimages/'
    'openimages-train-{000000..000554}.tar" --wds jpg,json --taming --truncate_captions '
    "--random_resize_crop_lower_ratio=0.8 --attn_types=full --epochs=2 --fp16 --deepspeed",
    "$ deepspeed train_dalle.py --taming --image_text_folder 'DatasetsDir' --distr_backend 'deepspeed' --amp",
]


IDS = ["tar", "shard_folder", "http_json", "amp"]


@pytest.fixture
def http_shards(files, pretrained_server):
    """The placeholders, with the README's openimages URLs served by the local server."""
    port = pretrained_server.server_address[1]
    pretrained_server.files.update({f"openimages-train-{n:06d}.tar": _read(files, n) for n in range(555)})
    return {**files, "http://storage.googleapis.com/nvdata-openimages": f"http://127.0.0.1:{port}"}


@pytest.mark.parametrize("command", FP16_DEEPSPEED, ids=IDS)
def test_deepspeed_fp16_commands_stop_on_a_cpu(command, http_shards, tmp_path, capsys):
    """As the README says it, in this process: on a CPU the one line that says fp16 needs a GPU."""
    with pytest.raises(SystemExit):
        run(command.replace("$ deepspeed ", "$ python "), http_shards, str(tmp_path))
    said = capsys.readouterr()
    assert "DeepSpeed fp16 needs a GPU" in said.err and "Traceback" not in said.err
    assert "--precision fp16" in said.out and "--distributed_backend deepspeed" in said.out


# under the deepspeed launcher on 2 ranks, without the precision flag; the slow two share the others' paths
LAUNCHED = [pytest.param(c, marks=[pytest.mark.slow] if i in ("shard_folder", "amp") else []) for c, i in
            zip(FP16_DEEPSPEED, IDS)]  # fmt: skip


@pytest.mark.launchers
@pytest.mark.parametrize("command", LAUNCHED, ids=IDS)
def test_deepspeed_commands_train_without_fp16(command, http_shards, tmp_path):
    out = run(command.replace(" --fp16", "").replace(" --amp", ""), http_shards, str(tmp_path))
    assert "done at step 2" in out and "--global_batch_size 4 --batch_size 2" in out


def _read(files, n: int) -> bytes:  # every URL serves the shard with jpg,json samples
    with open(files["<json shard>"], "rb") as f:
        return f.read()


@pytest.mark.launcher
@pytest.mark.launchers
def test_horovod(files, tmp_path):
    # the README's `horovodrun -np <num-gpus> <file>.py [args...] --distributed_backend horovod`
    command = "$ horovodrun -np 2 train_dalle.py --vae_path ./vae.pt --image_text_folder /path/to/data"
    out = run(command + " --distributed_backend horovod", files, str(tmp_path))
    assert "done at step 2" in out
    weights = safe_load(os.path.join(tmp_path, "dalle", "dalle.safetensors"))["weights"]
    assert all(torch.isfinite(w).all() for w in weights.values())
