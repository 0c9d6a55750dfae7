"""The 2024 recipe's model (a frozen T5 reading the captions, Llama blocks, guidance's caption dropout) under the
real launchers on 2 local ranks: the parameters of 1 process with the whole batch, as every backend must give
(tests/launchers/test_launchers.py's check, with the encoder on every rank and its features never trained); and
LlamaGen's T2I GPT fine-tuned from its file (train_dalle.py --dalle_path GPT.pt --vae_path VQ.pt) the same way."""

import os

import llamagen_files
import pytest
import torch
from helpers import ONE_THREAD
from launch import NORM_RTOL, assert_same, dalle_args, grad_norms, launch
from text_encoders import tiny_t5

import train_dalle
from dalle_pytorch.files import safe_load


def _args(vae_path, t5, out, batch):
    recipe = ["--text_encoder", "t5", "--text_encoder_path", t5, "--text_seq_len", "40", "--norm", "rmsnorm",
              "--ff", "swiglu", "--kv_heads", "1", "--ff_multiple_of", "16", "--rotary_emb"]  # fmt: skip
    return dalle_args(vae_path, out, batch, extra=recipe)


@pytest.fixture(scope="module")
def one_process(vae_path, tmp_path_factory):
    t5 = tiny_t5(str(tmp_path_factory.mktemp("t5")))
    out = str(tmp_path_factory.mktemp("one"))
    weights = safe_load(train_dalle.main(_args(vae_path, t5, out, 8)))["weights"]
    return t5, weights, grad_norms(os.path.join(out, "dalle"))


@pytest.mark.parametrize(
    "kind,extra",
    [
        # the default tier runs ZeRO-3 (parameters partitioned: the hardest for a frozen encoder beside the model);
        # the others under make test-all
        pytest.param("torchrun", ["--distributed_backend", "ddp"], marks=pytest.mark.slow),
        pytest.param("torchrun-fsdp", ["--distributed_backend", "fsdp"], marks=pytest.mark.slow),
        ("deepspeed", ["--zero_stage", "3"]),
        pytest.param("horovod", [], marks=pytest.mark.slow),
    ],
    ids=["ddp", "fsdp", "zero3", "horovod"],
)
def test_two_ranks_equal_one_process(kind, extra, one_process, vae_path, tmp_path):
    t5, ref_weights, ref_norms = one_process
    launch(kind, "train_dalle.py", [*_args(vae_path, t5, str(tmp_path), 4), *extra])
    run = os.path.join(tmp_path, "dalle")
    assert max(ref_norms) > 1.0  # clipping is active
    assert grad_norms(run) == pytest.approx(ref_norms, rel=NORM_RTOL)
    export = safe_load(os.path.join(run, "dalle.safetensors"))
    assert_same(ref_weights, export["weights"])
    assert "caption_proj.0.weight" in export["weights"] and "text_emb.weight" not in export["weights"]


def _llamagen_args(files: dict, out: str, batch: int) -> list[str]:
    args = dalle_args(files["vq"], out, batch, extra=["--pretrained_image_size", "16"])
    i = args.index("--dim")  # the GPT file fixes the model: TINY_DALLE_MODEL's flags go
    j = args.index(ONE_THREAD[0])
    return [
        "--dalle_path",
        files["gpt"],
        "--text_encoder",
        "t5",
        "--text_encoder_path",
        files["t5"],
        *args[:i],
        *args[j:],
    ]


@pytest.fixture(scope="module")
def llamagen(tmp_path_factory):
    """LlamaGen's small GPT and VQ files (tests/llamagen_files.py), a T5 of its caption width, and 1 process's run."""
    root = tmp_path_factory.mktemp("llamagen")
    files = {"vq": str(root / "vq.pt"), "gpt": str(root / "gpt.pt")}
    torch.save({"model": llamagen_files.vq_state_dict("small")}, files["vq"])
    torch.save({"model": llamagen_files.gpt_state_dict("small")}, files["gpt"])
    files["t5"] = tiny_t5(str(root / "t5"), d_model=llamagen_files.GPT["small"]["caption_dim"])
    out = str(root / "one")
    weights = safe_load(train_dalle.main(_llamagen_args(files, out, 8)))["weights"]
    return files, weights, grad_norms(os.path.join(out, "dalle"))


@pytest.mark.parametrize(
    "kind,extra",
    [
        # FSDP in the default tier (each of LlamaGen's blocks its own unit); the others under make test-all
        pytest.param("torchrun", ["--distributed_backend", "ddp"], marks=pytest.mark.slow),
        ("torchrun-fsdp", ["--distributed_backend", "fsdp"]),
        pytest.param("deepspeed", ["--zero_stage", "3"], marks=pytest.mark.slow),
        pytest.param("horovod", [], marks=pytest.mark.slow),
    ],
    ids=["ddp", "fsdp", "zero3", "horovod"],
)
def test_llamagen_gpt_fine_tunes_on_two_ranks_as_in_one_process(kind, extra, llamagen, tmp_path):
    files, ref_weights, ref_norms = llamagen
    launch(kind, "train_dalle.py", [*_llamagen_args(files, str(tmp_path), 4), *extra])
    run = os.path.join(tmp_path, "dalle")
    assert grad_norms(run) == pytest.approx(ref_norms, rel=NORM_RTOL)
    export = safe_load(os.path.join(run, "dalle.safetensors"))
    assert_same(ref_weights, export["weights"])
    assert export["config"]["llamagen_layout"] and "started from" in open(os.path.join(run, "train.log")).read()
