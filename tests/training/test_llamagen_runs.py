"""LlamaGen's published files through the scripts, at the small size of tests/llamagen_files.py (their numbers
against LlamaGen's own code: tests/models/test_llamagen.py): its VQ as train_dalle.py's, the encode command's and
generate.py's tokenizer and as train_vae.py's start; its T2I GPT converted with its VQ and a T5 into an export that
generate.py samples with guidance and top-k, and fine-tuned by train_dalle.py --dalle_path from the GPT file
itself. The launchers: tests/launchers/test_vqgan_ranks.py."""

from __future__ import annotations

import os
import shutil

import llamagen_files as files
import pytest
import torch
from helpers import ONE_THREAD, ROOT
from test_hub import put_in_cache, run
from text_encoders import tiny_t5

import generate
import train_dalle
import train_vae
from dalle_pytorch.convert import main as convert_main
from dalle_pytorch.files import safe_load
from dalle_pytorch.inference.load import load_dalle, load_vae

pytestmark = pytest.mark.e2e
RUN = [*ONE_THREAD, "--num_workers", "0", "--quiet", "--dataset_size", "32", "--batch_size", "4", "--steps", "2"]


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """LlamaGen's files as it publishes them ({"model": state dict, ...}), and a T5 of the caption width."""
    root = tmp_path_factory.mktemp("llamagen")
    vq, gpt = str(root / "vq_ds4_small.pt"), str(root / "t2i_small.pt")
    torch.save({"model": files.vq_state_dict("small"), "steps": 0}, vq)
    torch.save({"model": files.gpt_state_dict("small"), "steps": 0}, gpt)
    return {"vq": vq, "gpt": gpt, "t5": tiny_t5(str(root / "t5"), d_model=files.GPT["small"]["caption_dim"])}


def test_llamagen_vq_tokenizes_for_dalle_and_starts_a_vqgan_run(published, vgg16, tmp_path):
    side = str(files.VQ["small"]["image"])
    model = ["--dim", "32", "--depth", "1", "--heads", "2", "--dim_head", "16", "--text_seq_len", "8"]
    export = train_dalle.main(
        ["--vae_path", published["vq"], "--pretrained_image_size", side, *model, *RUN, "--output_dir", str(tmp_path)]
    )
    dalle, vae, _ = load_dalle(export)
    theirs, _ = load_vae(published["vq"], image_size=int(side))
    images = torch.rand(2, 3, int(side), int(side))
    assert torch.equal(vae.get_codebook_indices(images), theirs.get_codebook_indices(images))  # the VQ rides along
    generate.main(["--dalle_path", export, "--text", "a red circle", "--num_images", "1",
                   "--outputs_dir", str(tmp_path / "images")])  # fmt: skip
    assert list((tmp_path / "images" / "a_red_circle").glob("*.png"))

    start = train_vae.main(
        ["--vae_path", published["vq"], "--image_size", side, "--perceptual_weights", vgg16, "--disc_start", "1",
         "--disc_layers", "1", *RUN, "--output_dir", str(tmp_path / "vq")]
    )  # fmt: skip
    tuned, _ = load_vae(start)
    assert tuned.cfg.ch_mult == files.VQ["small"]["ch_mult"] and tuned.cfg.lowest_attn
    before, after = theirs.state_dict(), tuned.state_dict()
    moved = max((after[k] - before[k]).norm() / before[k].norm() for k in before if before[k].dim() > 1)
    assert 0 < moved < 0.2, f"2 steps moved a weight by {moved:.2f} of its norm: not started from the file"
    with pytest.raises(SystemExit) as e:  # the file fixes the architecture
        train_vae.main(["--vae_path", published["vq"], "--num_tokens", "32", *RUN, "--output_dir", str(tmp_path)])
    assert e.value.code == 2


def test_llamagen_t2i_gpt_converts_samples_and_fine_tunes(published, tmp_path):
    side = str(files.VQ["small"]["image"])
    out = str(tmp_path / "llamagen.safetensors")
    convert_main(["--from_llamagen", published["gpt"], "--vae_path", published["vq"], "--pretrained_image_size", side,
                  "--text_encoder_path", published["t5"], "--out", out])  # fmt: skip
    dalle, _, tokenizer = load_dalle(out)
    assert dalle.cfg.llamagen_layout and dalle.cfg.text_seq_len == 120 and tokenizer.kind == "text_encoder"
    images = tmp_path / "images"
    generate.main(["--dalle_path", out, "--text", "a red circle", "--num_images", "2", "--cond_scale", "4",
                   "--top_k", "10", "--top_p", "0.9", "--temperature", "1", "--outputs_dir", str(images)])  # fmt: skip
    assert len(list((images / "a_red_circle").glob("0*.png"))) == 2

    tuned = train_dalle.main(
        ["--dalle_path", published["gpt"], "--vae_path", published["vq"], "--pretrained_image_size", side,
         "--text_encoder", "t5", "--text_encoder_path", published["t5"], *RUN, "--output_dir", str(tmp_path / "ft")]
    )  # fmt: skip
    before, after = safe_load(out)["weights"], safe_load(tuned)["weights"]
    assert before.keys() == after.keys()
    moved = max((after[k] - before[k]).norm() / before[k].norm() for k in before if before[k].dim() > 1)
    assert 0 < moved < 0.2, f"2 steps moved a weight by {moved:.2f} of its norm: not started from the GPT"
    generate.main(["--dalle_path", tuned, "--text", "a blue square", "--num_images", "1",
                   "--outputs_dir", str(images)])  # fmt: skip
    with pytest.raises(SystemExit) as e:  # no vq_ds16_t2i.pt beside the GPT file: one line saying what to give
        generate.main(["--dalle_path", published["gpt"], "--text", "x", "--outputs_dir", str(images)])
    assert e.value.code == 2
    beside = tmp_path / "beside"  # as LlamaGen's folder (or Hub repository) holds them: the GPT finds its VQ
    beside.mkdir()
    shutil.copyfile(published["gpt"], beside / "t2i_XL_stage1_256.pt")
    shutil.copyfile(published["vq"], beside / "vq_ds16_t2i.pt")
    dalle, vae, tokenizer = load_dalle(str(beside / "t2i_XL_stage1_256.pt"), text_encoder_path=published["t5"])
    assert dalle.cfg.llamagen_layout and vae.image_size == 256 and dalle.cfg.image_fmap_size == 64  # stage 1's side
    assert tokenizer.path == published["t5"]


def test_llamagen_files_by_hub_name_offline(published, tmp_path):
    """FoundationVision/LlamaGen/FILE from a Hugging Face cache with HF_HUB_OFFLINE=1, as on an offline machine
    after `hf download FoundationVision/LlamaGen vq_ds16_t2i.pt t2i_XL_stage1_256.pt`."""
    folder = tmp_path / "repo"
    folder.mkdir()
    for name in ("vq", "gpt"):
        shutil.copyfile(published[name], folder / os.path.basename(published[name]))
    cache = str(tmp_path / "hf")
    put_in_cache(cache, "FoundationVision/LlamaGen", str(folder))
    env = {**os.environ, "HF_HUB_CACHE": cache, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    out = str(tmp_path / "llamagen.safetensors")
    hub = "FoundationVision/LlamaGen/"
    done = run(["-m", "dalle_pytorch.convert", "--from_llamagen", hub + os.path.basename(published["gpt"]),
                "--vae_path", hub + os.path.basename(published["vq"]), "--pretrained_image_size", "16",
                "--text_encoder_path", published["t5"], "--out", out], env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert load_dalle(out)[0].cfg.llamagen_layout
