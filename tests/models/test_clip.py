"""CLIP: the model and its loss, training under every launcher (2 ranks equal 1 process at the same global
batch, because the loss takes every rank's negatives), reranking in generate.py and its refusals."""

import json
import os

import pytest
import torch
from helpers import TINY_DALLE_MODEL, TINY_VAE_MODEL
from launch import NORM_RTOL, assert_same, grad_norms, launch

import generate
import train_clip
import train_dalle
import train_vae
from dalle_pytorch.files import safe_load
from dalle_pytorch.models.clip import CLIP, CLIPConfig

TINY_CLIP = ["--dim_text", "32", "--dim_image", "32", "--dim_latent", "32", "--heads", "2", "--patch_size", "4"]
QUIET = [
    "--num_workers",
    "0",
    "--quiet",
    "--dataset_size",
    "64",
    "--log_every",
    "1",
    "--sample_every",
    "0",
    "--threads",
    "1",
]


def tiny(**kw):
    torch.manual_seed(0)
    return CLIP(CLIPConfig(32, 1, 32, 1, 2, 4, 16, num_text_tokens=20, text_seq_len=6, image_size=16, **kw))


def test_loss_is_symmetric_infonce_with_the_learned_temperature():
    clip = tiny()
    g = torch.Generator().manual_seed(1)
    text, images = torch.randint(1, 20, (4, 6), generator=g), torch.rand(4, 3, 16, 16, generator=g)
    loss, metrics = clip(text, images)
    t, i = clip.embed_text(text), clip.embed_image(images)
    logits = clip.logit_scale.exp() * t @ i.T
    target = torch.arange(4)
    expected = torch.nn.functional.cross_entropy(logits, target) + torch.nn.functional.cross_entropy(logits.T, target)
    torch.testing.assert_close(loss, expected / 2)
    torch.testing.assert_close(t.norm(dim=-1), torch.ones(4))
    loss.backward()
    assert clip.logit_scale.grad is not None and clip.logit_scale.grad.item() != 0  # the temperature is learned
    # a gather that hands over two ranks' rows: as rank 1, the loss uses rank 0's pairs as negatives too
    with torch.no_grad():
        others = [clip.embed_text(text.flip(0)), clip.embed_image(images.flip(0))]  # "rank 0": text, then images
    calls = iter(others)
    loss1, _ = clip(text, images, lambda x: (torch.cat([next(calls), x]), 4))
    scale, ce = clip.logit_scale.exp(), torch.nn.functional.cross_entropy
    expected = ce(scale * t @ torch.cat([others[1], i]).T, target + 4) + ce(
        scale * i @ torch.cat([others[0], t]).T, target + 4
    )
    torch.testing.assert_close(loss1, expected / 2)


def test_padding_does_not_change_the_text_embedding():
    clip = tiny()
    text = torch.tensor([[3, 4, 5, 0, 0, 0]])
    other = text.clone()
    other[0, 4] = 0
    torch.testing.assert_close(clip.embed_text(text), clip.embed_text(other))
    assert not torch.allclose(clip.embed_text(text), clip.embed_text(torch.tensor([[3, 4, 6, 0, 0, 0]])))


@pytest.fixture(scope="module")
def dalle_path(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dalle"))
    vae = train_vae.main([*TINY_VAE_MODEL, *QUIET, "--batch_size", "8", "--steps", "2", "--output_dir", out])
    args = ["--vae_path", vae, *TINY_DALLE_MODEL, *QUIET, "--batch_size", "8", "--steps", "2", "--output_dir", out]
    return train_dalle.main([*args, "--null_cond_prob", "0.2"])


def clip_args(dalle_path, out, batch, extra=()):
    return [
        "--dalle_path",
        dalle_path,
        *TINY_CLIP,
        *QUIET,
        "--batch_size",
        str(batch),
        "--steps",
        "3",
        "--output_dir",
        out,
        "--warmup_steps",
        "0",
        "--learning_rate",
        "3e-3",
        "--clip_grad_norm",
        "0.5",
        *extra,
    ]


@pytest.fixture(scope="module")
def reference(dalle_path, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("clip1"))
    weights = safe_load(train_clip.main(clip_args(dalle_path, out, 16)))["weights"]
    return weights, grad_norms(os.path.join(out, "clip"))


@pytest.mark.launcher
@pytest.mark.parametrize(
    "kind,extra",
    [
        ("torchrun", []),
        ("torchrun", ["--distributed_backend", "fsdp"]),
        ("deepspeed", ["--zero_stage", "2"]),
        ("horovod", []),
    ],
    ids=["ddp", "fsdp", "deepspeed-2", "horovod"],
)
def test_two_ranks_equal_one_process_at_the_same_global_batch(kind, extra, dalle_path, reference, tmp_path):
    """8 pairs per rank x 2 ranks, the negatives gathered across ranks = 16 pairs in one process. Without the
    gather each rank would see 8 negatives and the loss (and its gradients) would differ."""
    launch(kind, "train_clip.py", clip_args(dalle_path, str(tmp_path), 8, extra))
    run = os.path.join(tmp_path, "clip")
    ref_weights, ref_norms = reference
    assert max(ref_norms) > 0.5  # clipping is active
    assert grad_norms(run) == pytest.approx(ref_norms, rel=NORM_RTOL)
    assert_same(ref_weights, safe_load(os.path.join(run, "clip.safetensors"))["weights"])


@pytest.mark.e2e
def test_generate_reranks_with_guidance_priming_and_compile(dalle_path, tmp_path):
    clip_path = train_clip.main(clip_args(dalle_path, str(tmp_path), 16))
    common = ["--dalle_path", dalle_path, "--text", "a red circle", "--num_images", "6", "--quiet"]
    for i, extra in enumerate([[], ["--cond_scale", "2"], ["--img", _an_image(tmp_path)], ["--compile"]]):
        out = str(tmp_path / f"out{i}")
        folder = generate.main([*common, "--clip_path", clip_path, "--keep", "3", "--outputs_dir", out, *extra])[0]
        scores = json.load(open(os.path.join(folder, "settings.json")))["clip_scores"]
        assert len(scores) == 3 and scores == sorted(scores, reverse=True)
        assert sorted(os.listdir(folder)) == ["0000.png", "0001.png", "0002.png", "grid.png", "settings.json"]
    # the kept images are the best-scored of all six, in order
    from PIL import Image

    from dalle_pytorch.data.folders import image_transform
    from dalle_pytorch.inference.load import load_clip
    from dalle_pytorch.models.clip import rank_by_clip

    clip, tokenizer = load_clip(clip_path)
    folder = os.path.join(tmp_path / "out0", "a_red_circle")
    kept = torch.stack(
        [image_transform(16, train=False)(Image.open(os.path.join(folder, f"{i:04d}.png"))) for i in range(3)]
    )
    rescored = rank_by_clip(clip, tokenizer, "a red circle", kept)
    saved = json.load(open(os.path.join(folder, "settings.json")))["clip_scores"]
    assert rescored.tolist() == pytest.approx(saved, abs=2e-2)  # PNG rounding moves the scores a little


def _an_image(tmp_path):
    from dalle_pytorch.data.shapes import sample

    path = str(tmp_path / "prime.png")
    sample(0, 0, 16, "train")[0].save(path)
    return path


@pytest.mark.e2e
def test_a_clip_that_does_not_fit_is_refused(dalle_path, tmp_path, capsys):
    other = train_clip.main(
        [
            *TINY_CLIP,
            *QUIET,
            "--tokenizer",
            "byte",
            "--image_size",
            "32",
            "--steps",
            "1",
            "--batch_size",
            "4",
            "--output_dir",
            str(tmp_path),
            "--text_seq_len",
            "12",
        ]
    )
    with pytest.raises(SystemExit):
        generate.main(["--dalle_path", dalle_path, "--text", "a", "--clip_path", other, "--outputs_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert "reads 3x32px images" in err and "train_clip.py --dalle_path" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        generate.main(["--dalle_path", dalle_path, "--text", "a", "--keep", "2", "--outputs_dir", str(tmp_path)])
    assert "--keep ranks the images with CLIP: give --clip_path" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["text_depth", "image_depth"])
def test_encoders_need_a_block(flag):
    with pytest.raises(ValueError, match=f"--{flag} must be at least 1 .got 0."):
        CLIPConfig(**{flag: 0})


@pytest.mark.e2e
def test_the_evaluation_reranks_with_clip(dalle_path, tmp_path):
    """python -m dalle_pytorch.eval with --clip_path: plain and reranked rows per split, CLIP's retrieval,
    and the best rate any reranker could reach with these candidates."""
    from dalle_pytorch.eval import evaluate

    clip_path = train_clip.main(clip_args(dalle_path, str(tmp_path), 16))
    args = ["--dalle_path", dalle_path, "--clip_path", clip_path, "--num_images", "3", "--candidates", "4"]
    d = evaluate.main([*args, "--out", str(tmp_path / "eval")])["dalle"]
    for split in ("seen", "heldout"):
        assert d[split]["n"] == 12 and d[f"{split}_reranked"]["n"] == 3
        best = d["reranking"][f"{split}_best_possible"]
        assert d[f"{split}_reranked"]["full"]["mean"] <= best <= 1
    assert 0 <= d["clip_retrieval"]["top1"] <= 1
    assert "heldout_reranked" in open(tmp_path / "eval" / "results.txt").read()
