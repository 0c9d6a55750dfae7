"""The frozen text encoders against `transformers`' own forward on the same files (tests/text_encoders.py)."""

import os

import pytest
import torch
from text_encoders import CAPTIONS, tiny_clip, tiny_t5

from dalle_pytorch.data.encoder_tokenizer import EncoderTokenizer
from dalle_pytorch.data.tokenizer import tokenizer_from_dict
from dalle_pytorch.inference.text_encoders import FrozenTextEncoder, load_text_encoder

BUILD = {"t5": tiny_t5, "clip": tiny_clip}


@pytest.fixture(scope="module", params=["t5", "clip"])
def encoder(request, tmp_path_factory):
    kind = request.param
    path = BUILD[kind](str(tmp_path_factory.mktemp(kind)))
    return FrozenTextEncoder(EncoderTokenizer(kind, path), "cpu")


def _reference(encoder, captions):
    """transformers' own: its tokenizer padding the batch, its model's forward, the real tokens' states."""
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

    cls = {"t5": T5EncoderModel, "clip": CLIPTextModel}[encoder.tokenizer.encoder]
    tok = AutoTokenizer.from_pretrained(encoder.tokenizer.path)
    model = cls.from_pretrained(encoder.tokenizer.path).eval()
    batch = tok(captions, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    return [h[i, batch["attention_mask"][i].bool()] for i in range(len(captions))]


def test_features_equal_the_librarys_forward_for_padded_captions_of_different_lengths(encoder):
    T = 64
    ids, cut = encoder.tokenizer.tokenize(CAPTIONS, T)
    assert cut == 0 and len(set((ids > 0).sum(1).tolist())) > 2  # lengths differ: padding in the batch
    ours32 = encoder.features(ids, torch.float32)
    ours16 = encoder.features(ids)
    assert ours16.dtype == torch.float16
    for i, ref in enumerate(_reference(encoder, CAPTIONS)):
        n = ref.shape[0]
        assert (ids[i, :n] > 0).all() and (ids[i, n:] == 0).all()
        torch.testing.assert_close(ours32[i, :n], ref, rtol=0, atol=1e-5)
        torch.testing.assert_close(ours16[i, :n].float(), ref, rtol=2**-10, atol=1e-5)  # fp16 rounding
        assert not ours16[i, n:].any()  # padding is the zero vector
    alone = encoder.features(encoder.tokenizer.tokenize(CAPTIONS[2], T)[0], torch.float32)
    torch.testing.assert_close(alone[0], ours32[2], rtol=0, atol=1e-5)  # padding does not change a caption


def test_truncation_keeps_the_closing_token_and_an_empty_row_stays_padding(encoder):
    tok = encoder.tokenizer
    ids, cut = tok.tokenize(CAPTIONS[1], 4)
    assert cut == 1 and ids[0, -1].item() - 1 == tok.hf.eos_token_id
    with pytest.raises(ValueError, match="--text_seq_len"):
        tok.tokenize(CAPTIONS[1], 4, truncate=False)
    empty = torch.zeros(1, 4, dtype=torch.long)
    assert not encoder.features(empty).any()


def test_a_record_reloads_the_same_encoder_and_refuses_another(encoder, tmp_path):
    record = encoder.record()
    assert record["kind"] == "text_encoder" and len(record["fingerprint"]) == 16
    tok, again = load_text_encoder(record)
    assert again.fingerprint == encoder.fingerprint and tok.to_dict() == record
    other = BUILD[record["encoder"]](str(tmp_path / "other"), seed=1)
    with pytest.raises(ValueError, match="not the encoder this DALLE was trained with"):
        load_text_encoder(record, path=other)
    assert isinstance(tokenizer_from_dict(record, other), EncoderTokenizer)


def test_a_name_neither_here_nor_cached_offline_is_one_line(vae_path, tmp_path):
    """train_dalle.py on an offline machine (HF_HUB_OFFLINE=1, read when the hub library loads) whose cache lacks
    the encoder: one line naming what to put where, before any training."""
    import subprocess
    import sys

    from helpers import ROOT

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    args = ["--vae_path", vae_path, "--text_encoder", "t5", "--text_encoder_path", "nobody/no-such-t5",
            "--output_dir", str(tmp_path)]  # fmt: skip
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train_dalle.py"), *args, "--threads", "1"],
                         env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --text_encoder_path nobody/no-such-t5: no such folder") and "hf download" in last
