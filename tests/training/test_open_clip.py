"""Published CLIPs through open_clip (--clip_path ViT-B-32:FILE, as offline machines pass OpenAI's or LAION's
weights): a ViT-B-32 with fixed random values scores as open_clip's own forward does in this test (its tokenizer,
its preprocessing's mean and std, its encoders), within 1e-4; generate.py reranks with it, the evaluation's CLIP
score uses it and results.json names it, --val_clip_path scores with it; a name open_clip lacks is one line."""

from __future__ import annotations

import json

import open_clip
import pytest
import torch
import torch.nn.functional as F

import generate
from dalle_pytorch.inference.load import load_clip

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def vit_b_32(tmp_path_factory):
    """open_clip's ViT-B-32 with fixed random values, saved as its released weights are (a state dict)."""
    torch.manual_seed(0)
    model = open_clip.create_model("ViT-B-32")
    path = str(tmp_path_factory.mktemp("open_clip") / "vit_b_32_random.bin")
    torch.save(model.state_dict(), path)
    return path


def test_scores_equal_open_clips_own_forward(vit_b_32):
    clip, tokenizer = load_clip(f"ViT-B-32:{vit_b_32}")
    theirs = open_clip.create_model("ViT-B-32", pretrained=vit_b_32).eval()
    _, _, preprocess = open_clip.create_model_and_transforms("ViT-B-32", pretrained=vit_b_32)
    normalize = preprocess.transforms[-1]  # open_clip's Normalize with the model's mean and std
    captions = ["a red circle on the left", "two blue squares"]
    images = torch.rand(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        text = open_clip.get_tokenizer("ViT-B-32")(captions)
        t = F.normalize(theirs.encode_text(text), dim=-1)
        i = F.normalize(theirs.encode_image(normalize(images)), dim=-1)
        ids, _ = tokenizer.tokenize(captions, clip.cfg.text_seq_len)
        ours = clip.score(ids, images)
    assert torch.equal(ids, text)
    assert (ours - (t * i).sum(-1)).abs().max() <= 1e-4
    with torch.no_grad():  # another side is resized to the model's, as its preprocessing does
        small = clip.score(ids, F.interpolate(images, size=(64, 64), mode="area"))
    assert small.shape == (2,) and torch.isfinite(small).all()


@pytest.mark.slow  # ~60 s: FID and a ViT-B-32 in training, the evaluation's candidates
def test_reranks_generated_images_and_names_itself_in_results(vit_b_32, vae_path, inception, tmp_path):
    from launch import dalle_args
    from test_fid_during_training import FID

    import train_dalle
    from dalle_pytorch.eval import evaluate

    extra = [*FID, "--inception_weights", inception, "--val_clip_path", f"ViT-B-32:{vit_b_32}"]
    dalle = train_dalle.main(dalle_args(vae_path, str(tmp_path), 8, steps=2, extra=extra))
    rows = [json.loads(line) for line in open(tmp_path / "dalle" / "metrics.jsonl")]
    assert any("val_clip_score" in r for r in rows)
    name = f"ViT-B-32:{vit_b_32}"
    out = tmp_path / "images"
    generate.main(["--dalle_path", dalle, "--text", "a red circle", "--num_images", "3", "--clip_path", name,
                   "--keep", "2", "--outputs_dir", str(out)])  # fmt: skip
    assert len(list((out / "a_red_circle").glob("0*.png"))) == 2
    results = evaluate.main(["--dalle_path", dalle, "--clip_path", name, "--num_images", "4", "--candidates", "2",
                             "--out", str(tmp_path / "eval")])  # fmt: skip
    assert results["dalle"]["clip"] == {"kind": "open_clip", "name": name} and "clip_retrieval" in results["dalle"]
    assert json.load(open(tmp_path / "eval" / "results.json"))["dalle"]["clip"]["name"] == name
    with pytest.raises(SystemExit) as e:
        generate.main(["--dalle_path", dalle, "--text", "x", "--clip_path", "ViT-B-32:no_such_tag",
                       "--outputs_dir", str(out)])  # fmt: skip
    assert e.value.code == 2
