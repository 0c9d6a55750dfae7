"""--checkpoint_activations: recomputing each transformer block in backward gives the gradients of the
run that keeps every activation, in one process for every model option and under every backend on 2 ranks."""

import os

import pytest
import torch
from launch import assert_same, dalle_args, grad_norms, launch
from test_dalle import VARIANTS, batch, model

from dalle_pytorch.files import safe_load


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_recomputed_gradients_equal_kept_ones(kw):
    grads = []
    for recompute in (False, True):
        m = model(**kw, attn_dropout=0.1, ff_dropout=0.1).train()
        m.transformer.checkpoint_activations = recompute
        torch.manual_seed(3)  # the same dropout masks: checkpoint replays the RNG state in the recomputation
        loss, _ = m(*batch())
        loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_recomputation_keeps_fewer_activations():
    """The autograd graph of a checkpointed forward holds only each block's input."""
    saved = []
    for recompute in (False, True):
        m = model(**VARIANTS[0]).train()
        m.transformer.checkpoint_activations = recompute
        count = [0]

        def pack(t, count=count):
            count[0] += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(*batch())
        saved.append(count[0])
    assert saved[1] < saved[0] / 2, saved


@pytest.mark.e2e
def test_models_without_blocks_refuse_the_flag(tmp_path, capsys):
    from helpers import TINY_VAE_MODEL

    import train_vae

    with pytest.raises(SystemExit):
        train_vae.main([*TINY_VAE_MODEL, "--steps", "1", "--output_dir", str(tmp_path), "--checkpoint_activations"])
    assert "--checkpoint_activations: the vae model has no transformer blocks" in capsys.readouterr().err


CASES = [
    ("torchrun", ["--distributed_backend", "ddp", "--global_batch_size", "16"]),
    ("torchrun-fsdp", ["--distributed_backend", "fsdp"]),
    ("deepspeed", ["--zero_stage", "0"]),
    ("deepspeed", ["--zero_stage", "2", "--global_batch_size", "16"]),
    ("deepspeed", ["--zero_stage", "3"]),
    ("horovod", ["--global_batch_size", "16"]),
]


@pytest.mark.launcher
@pytest.mark.parametrize("kind,extra", CASES, ids=[f"{k}-{' '.join(e[1:])}" for k, e in CASES])
def test_two_ranks_with_recomputation_equal_one_process_without(kind, extra, vae_path, reference, tmp_path):
    launch(kind, "train_dalle.py", dalle_args(vae_path, str(tmp_path), 4, extra=[*extra, "--checkpoint_activations"]))
    run = os.path.join(tmp_path, "dalle")
    ref_weights, ref_norms = reference[16 if "--global_batch_size" in extra else 8]
    assert grad_norms(run) == pytest.approx(ref_norms, rel=1e-4)
    assert_same(ref_weights, safe_load(os.path.join(run, "dalle.safetensors"))["weights"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_recomputation_under_autocast_gives_the_same_gradients(dtype):
    """The recomputation runs under the autocast state of the forward it replays."""
    grads = []
    for recompute in (False, True):
        m = model(shift_tokens=True, rotary_emb=True).train()
        m.transformer.checkpoint_activations = recompute
        with torch.autocast("cpu", dtype=dtype):
            loss, _ = m(*batch())
        loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, msg=name)


@pytest.mark.e2e
@pytest.mark.slow
def test_recomputation_with_compile_trains(vae_path, tmp_path):
    import train_dalle

    args = dalle_args(vae_path, str(tmp_path), 8, extra=["--checkpoint_activations", "--compile"])
    weights = safe_load(train_dalle.main(args))["weights"]
    assert all(torch.isfinite(w).all() for w in weights.values())
