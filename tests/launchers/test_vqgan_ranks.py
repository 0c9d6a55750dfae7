"""train_vae.py --model vqgan under the real launchers: the tokenizer and its discriminator (one module, one loss)
on 2 ranks equal 1 process with the whole batch, under FSDP2 (each block its own unit) and DeepSpeed ZeRO-3 (the
discriminator's frozen pass reads weights that ZeRO gathers by its hooks); a sharded checkpoint of 2 ranks resumes
in 1 process to the uninterrupted run's weights. DDP, Horovod and Ray Train (DDP) were checked the same way by hand.

The model is 64 channels wide, not 32: at 32 channels GroupNorm(32) puts one channel in each group, which cancels
the bias of the convolution before it exactly; that bias's gradient is then rounding noise, which Adam's first step
turns into +-lr whose sign depends on the order of the sums, so the runs part after one step (seen here: 1 process
with accumulation 2 x 4 parted from 1 x 8 alike). At 64 channels no gradient is identically zero."""

from __future__ import annotations

import os

import llamagen_files
import pytest
import torch
from helpers import ONE_THREAD
from launch import NORM_RTOL, assert_same, grad_norms, launch, restart_from_step_2

import train_vae
from dalle_pytorch.files import safe_load
from dalle_pytorch.inference.load import load_vae

pytestmark = pytest.mark.launcher


def vqgan_args(out: str, batch: int, vgg16: str, extra=()) -> list[str]:
    model = ["--model", "vqgan", "--image_size", "16", "--num_tokens", "16", "--hidden_dim", "64", "--num_layers", "1"]
    model += ["--disc_hidden_dim", "16", "--disc_layers", "1", "--disc_start", "2", "--perceptual_weights", vgg16]
    run = ["--batch_size", str(batch), "--num_workers", "0", "--quiet", "--dataset_size", "200", "--log_every", "1"]
    run += ["--steps", "4", "--output_dir", out, "--warmup_steps", "0", "--learning_rate", "3e-3"]
    run += ["--clip_grad_norm", "1.0", "--save_every_n_steps", "2", "--sample_every", "2", "--keep_n_checkpoints", "5"]
    return [*model, *ONE_THREAD, *run, *extra]


@pytest.fixture(scope="module")
def one_process(vgg16, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("vqgan-one"))
    export = train_vae.main(vqgan_args(out, 8, vgg16))
    return safe_load(export)["weights"], grad_norms(os.path.join(out, "vae"))


@pytest.mark.parametrize(
    "kind,extra",
    [("torchrun", ["--distributed_backend", "fsdp"]), ("deepspeed", ["--zero_stage", "3"])],
    ids=["fsdp", "zero3"],
)
def test_two_ranks_equal_one_process(kind, extra, one_process, vgg16, tmp_path):
    weights, norms = one_process
    launch(kind, "train_vae.py", vqgan_args(str(tmp_path), 4, vgg16, extra))
    run = tmp_path / "vae"
    assert grad_norms(run) == pytest.approx(norms, rel=NORM_RTOL)
    assert_same(weights, safe_load(str(run / "vae.safetensors"))["weights"])
    assert "discriminator" not in " ".join(weights)  # the export holds the tokenizer alone
    if kind == "torchrun":  # the sharded checkpoint of step 2 (discriminator and all) resumed by 1 process
        restart_from_step_2(run, tmp_path / "one" / "vae")
        train_vae.main([*vqgan_args(str(tmp_path / "one"), 4, vgg16, ["--global_batch_size", "8"]), "--resume", "auto"])
        assert_same(weights, safe_load(str(tmp_path / "one" / "vae" / "vae.safetensors"))["weights"])


@pytest.fixture(scope="module")
def llamagen_vq(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llamagen") / "vq.pt")
    torch.save({"model": llamagen_files.vq_state_dict("launcher"), "steps": 0}, path)
    return path


def started_args(out: str, batch: int, vgg16: str, vq: str, extra=()) -> list[str]:
    """vqgan_args without the architecture, which LlamaGen's file fixes."""
    args = vqgan_args(out, batch, vgg16, extra)
    for name in ("--model", "--num_tokens", "--hidden_dim", "--num_layers"):
        i = args.index(name)
        del args[i : i + 2]
    return ["--vae_path", vq, *args]


@pytest.mark.parametrize(
    "kind,extra",
    [
        ("deepspeed", ["--zero_stage", "3"]),
        ("torchrun", ["--distributed_backend", "ddp"]),
        ("torchrun-fsdp", ["--distributed_backend", "fsdp"]),
        ("horovod", []),
    ],
    ids=["zero3", "ddp", "fsdp", "horovod"],
)
def test_llamagen_vq_fine_tunes_on_two_ranks_as_in_one_process(kind, extra, llamagen_vq, vgg16, tmp_path):
    """train_vae.py --vae_path LlamaGen's VQ: 2 ranks equal 1 process, both started from the file's weights.

    Except the attention blocks' key biases: softmax is invariant to a score shift shared by every key, so their
    gradient is zero in exact arithmetic and rounding noise in practice, which Adam's normalized step turns into
    moves whose sign depends on the order of the sums (seen under ZeRO-3: 1.6e-5 on 4 of 64 values after 4 steps).
    Ours start at zero and stay near it; LlamaGen's file brings nonzero ones. They may move by at most lr x steps."""
    export = train_vae.main(started_args(str(tmp_path / "one"), 8, vgg16, llamagen_vq))
    launch(kind, "train_vae.py", started_args(str(tmp_path), 4, vgg16, llamagen_vq, extra))
    weights = safe_load(export)["weights"]
    ranks = safe_load(str(tmp_path / "vae" / "vae.safetensors"))["weights"]
    key_bias = [k for k in weights if k.endswith(".k.bias")]
    for k in key_bias:
        assert (weights[k] - ranks[k]).abs().max() <= 3e-3 * 4, k
    assert_same(
        {k: v for k, v in weights.items() if k not in key_bias}, {k: ranks[k] for k in weights if k not in key_bias}
    )
    start = load_vae(llamagen_vq, image_size=16)[0].state_dict()
    assert weights.keys() == start.keys() and not torch.equal(weights["quant_conv.weight"], start["quant_conv.weight"])
