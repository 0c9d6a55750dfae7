"""The predecessor's text tokenizers: OpenAI CLIP's BPE (`--tokenizer clip`) and bert-base-chinese's WordPiece
(`--tokenizer chinese`) give the ids lucidrains' DALLE-pytorch 1.6.6 gave, survive an export, and train.

The expected ids are fixtures computed once from the predecessor: tests/fixtures/clip_bpe_ids.json from its
SimpleTokenizer (`PYTHONPATH=.:tests python tests/data/test_tokenizers.py` rewrites it from an unpacked
dalle-pytorch==1.6.6 wheel:
`pip download --no-deps dalle-pytorch==1.6.6` and unzip it, then set DALLE_PYTORCH_166 to its dalle_pytorch/),
tests/fixtures/chinese_bert_ids.json from transformers' BertTokenizer in a separate venv (transformers pins
other tokenizers versions than ours). With those at hand the tests compare live too, else they skip that part.
bert-base-chinese's vocab.txt is found by --bpe_path's rules: DALLE_CHINESE_VOCAB, or the cn-clip package.
"""

import importlib.util
import json
import os
import pickle
import sys
import types

import pytest
import torch
from helpers import FIXTURES, ONE_THREAD, TINY_DALLE_MODEL, TINY_VAE_MODEL

from dalle_pytorch.config import pick
from dalle_pytorch.data.build import TextTokenizerConfig, build_text_tokenizer
from dalle_pytorch.data.chinese import ChineseTokenizer, packaged_vocab
from dalle_pytorch.data.clip_bpe import BUNDLED, ClipTokenizer, read_merges
from dalle_pytorch.data.tokenizer import tokenizer_from_dict

PREDECESSOR = os.environ.get("DALLE_PYTORCH_166", "/tmp/dp166_tok/pkg/dalle_pytorch")
CHINESE_VOCAB = os.environ.get("DALLE_CHINESE_VOCAB", "") or packaged_vocab()
FLAGS = {"bpe_path": "", "hug": False, "bpe_vocab_size": 64}


def _cases(name):
    with open(os.path.join(FIXTURES, name), encoding="utf-8") as f:
        return json.load(f)["cases"]


@pytest.fixture(scope="module")
def clip():
    return ClipTokenizer.from_file()


@pytest.fixture(scope="module")
def chinese():
    if not CHINESE_VOCAB:
        pytest.skip("bert-base-chinese's vocab.txt: set DALLE_CHINESE_VOCAB or `pip install --no-deps cn-clip`")
    return ChineseTokenizer.from_file(CHINESE_VOCAB)


def predecessor_simple_tokenizer():
    """dalle-pytorch 1.6.6's SimpleTokenizer, imported from its file; transformers (needed only by its
    ChineseTokenizer) is stubbed when missing, and the stub is removed again."""
    path = os.path.join(PREDECESSOR, "tokenizer.py")
    if not os.path.exists(path):
        return None
    stub = importlib.util.find_spec("transformers") is None
    if stub:
        sys.modules["transformers"] = types.SimpleNamespace(BertTokenizer=None)
    try:
        spec = importlib.util.spec_from_file_location("dalle_pytorch_166_tokenizer", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if stub:
            del sys.modules["transformers"]
    return module.SimpleTokenizer()


# --- CLIP's BPE


def test_clip_ids_equal_the_predecessors(clip):
    cases = _cases("clip_bpe_ids.json")
    assert clip.vocab_size == 49408
    for case in cases:
        assert clip.encode(case["text"]) == case["ids"], case["text"]
    reference = predecessor_simple_tokenizer()
    if reference is None:
        pytest.skip(f"no dalle-pytorch 1.6.6 at {PREDECESSOR} (DALLE_PYTORCH_166): compared with the fixture only")
    for text in [c["text"] for c in cases] + ["A Photo of a CAT!!", "zebra-striped café at 3am &c."]:
        assert clip.encode(text) == reference.encode(text), text


def test_clip_decodes_what_it_encodes(clip):
    assert clip.decode(clip.encode("A painting of a fox in the style of Claude Monet")) == (
        "a painting of a fox in the style of claude monet"
    )
    assert clip.decode(clip.encode("Fish &amp;amp; chips at the café, naïve résumé")) == (
        "fish & chips at the café , naïve résumé"  # CLIP's pieces keep no space before punctuation
    )
    assert clip.decode(clip.encode("emoji 🐱🚀 日本語 ελληνικά 12345")) == "emoji 🐱🚀 日本語 ελληνικά 1 2 3 4 5"
    for case in _cases("clip_bpe_ids.json"):
        if 0 in case["ids"]:
            continue  # the '!' that is id 0 in CLIP's vocabulary is padding, and decode leaves it out
        text = clip.decode(case["ids"])  # without <|startoftext|> and <|endoftext|>
        assert clip.encode(text) == [i for i in case["ids"] if i < 49406], (case["text"], text)


def test_clip_decode_fixes_the_predecessors_bugs(clip):
    # the predecessor dropped 40407 ("berwick") instead of 49407 (<|endoftext|>), and raised on ids past the vocab
    start, end = clip.encode("<|startoftext|>")[0], clip.encode("<|endoftext|>")[0]
    assert (start, end) == (49406, 49407)
    ids = [start, *clip.encode("a postcard from berwick"), end, 0, 0, 49408, 49420]
    assert clip.decode(ids) == "a postcard from berwick"
    assert clip.encode("!$") == [0, 259]  # the documented collision: this '!' is id 0, which is padding


def test_clip_tokenize_pads_and_truncates(clip):
    ids, truncated = clip.tokenize(["a red circle", "a very long caption about many different things"], 6)
    assert ids.shape == (2, 6) and ids.dtype == torch.long and truncated == 1
    assert ids[0].tolist() == [*clip.encode("a red circle"), 0, 0, 0]
    assert ids[1].tolist() == clip.encode("a very long caption about many different things")[:6]
    with pytest.raises(ValueError, match="--text_seq_len"):
        clip.tokenize("a very long caption about many different things", 6, truncate=False)


def test_clip_to_dict_rebuilds_it_and_reads_a_file_of_ones_own(clip, tmp_path):
    d = clip.to_dict()
    assert d["kind"] == "clip" and json.loads(json.dumps(d)) == d
    again = tokenizer_from_dict(d)
    assert again.to_dict() == d and again.vocab_size == 49408
    assert again.encode("a red circle, 3 blue squares!") == clip.encode("a red circle, 3 blue squares!")
    # data workers started by spawn get the tokenizer pickled
    assert pickle.loads(pickle.dumps(clip)).encode("a  red\tcircle") == clip.encode("a red circle")
    # a plain-text CLIP file with fewer merges (as --bpe_path): 512 byte ids + merges + 2 special tokens
    small = tmp_path / "small_bpe.txt"
    small.write_text("\n".join(read_merges(BUNDLED).split("\n")[:1001]) + "\n")
    own = build_text_tokenizer(
        pick(TextTokenizerConfig, {**FLAGS, "tokenizer": "clip", "bpe_path": str(small)}), str(tmp_path)
    )
    assert own.vocab_size == 512 + 1000 + 2 and own.decode(own.encode("the cat")) == "the cat"
    with pytest.raises(ValueError, match="drop --hug"):
        build_text_tokenizer(pick(TextTokenizerConfig, {**FLAGS, "tokenizer": "clip", "hug": True}), str(tmp_path))
    with pytest.raises(FileNotFoundError, match="--bpe_path"):
        build_text_tokenizer(
            pick(TextTokenizerConfig, {**FLAGS, "tokenizer": "clip", "bpe_path": str(tmp_path / "nope.txt")}),
            str(tmp_path),
        )


# --- bert-base-chinese's WordPiece


def _tiny_vocab(path, texts):
    """A BERT vocab.txt over the characters of `texts` (the real one is not always at hand)."""
    chars = sorted({c for t in texts for c in t if not c.isspace()})
    tokens = ["[PAD]", "[unused1]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "##s", *chars]
    path.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    return str(path)


SENTENCES = ["一只可爱的小猫坐在窗台上。", "我爱北京天安门，天安门上太阳升！", "日落时分，海边的灯塔（油画风格）"]


def test_chinese_mechanics_on_a_vocab_of_ones_own(tmp_path):
    vocab = _tiny_vocab(tmp_path / "vocab.txt", SENTENCES)
    tok = build_text_tokenizer(
        pick(TextTokenizerConfig, {**FLAGS, "tokenizer": "chinese", "bpe_path": vocab}), str(tmp_path)
    )
    for text in SENTENCES:
        ids = tok.encode(text)
        assert len(ids) == len(text) and 0 not in ids  # a character a token, never padding
        assert tok.decode(ids) == text
    assert tok.encode("hello worlds 猫") == [6, 7, 8, tok.encode("猫")[0]]
    assert tok.decode([*tok.encode("hello 猫 ?"), 0, 0, 10_000]) == "hello猫[UNK]"
    again = tokenizer_from_dict(tok.to_dict())
    assert again.to_dict() == tok.to_dict() and again.encode(SENTENCES[1]) == tok.encode(SENTENCES[1])
    assert pickle.loads(pickle.dumps(tok)).encode(SENTENCES[1]) == tok.encode(SENTENCES[1])
    ids, truncated = tok.tokenize(SENTENCES, 8)
    assert ids.shape == (3, 8) and truncated == 3
    assert tok.tokenize("我爱猫", 5)[0][0].tolist() == [*tok.encode("我爱猫"), 0, 0]
    # the same vocabulary from a tokenizers JSON (as bert-base-chinese's tokenizer.json carries it)
    from tokenizers import BertWordPieceTokenizer

    BertWordPieceTokenizer(vocab, lowercase=False).save(str(tmp_path / "tokenizer.json"))
    from_json = ChineseTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert from_json.vocab_text == tok.vocab_text


def test_chinese_without_a_vocabulary_says_where_to_get_one(tmp_path, monkeypatch):
    import dalle_pytorch.data.chinese as chinese

    monkeypatch.setattr(chinese, "packaged_vocab", lambda: "")
    with pytest.raises(FileNotFoundError, match="--bpe_path vocab.txt"):
        build_text_tokenizer(pick(TextTokenizerConfig, {**FLAGS, "tokenizer": "chinese"}), str(tmp_path))
    bad = tmp_path / "bad.txt"
    bad.write_text("a\nb\n")
    with pytest.raises(ValueError, match="not a BERT vocab.txt"):
        build_text_tokenizer(
            pick(TextTokenizerConfig, {**FLAGS, "tokenizer": "chinese", "bpe_path": str(bad)}), str(tmp_path)
        )


def test_chinese_ids_equal_bert_base_chineses(chinese):
    assert chinese.vocab_size == 21128
    cases = _cases("chinese_bert_ids.json")
    for case in cases:
        assert chinese.encode(case["text"]) == case["ids"], case["text"]
    for text in SENTENCES:
        assert chinese.decode(chinese.encode(text)) == text
    try:  # transformers 4.x's BertTokenizer, as the predecessor loaded it, where it is installed
        from transformers import BertTokenizer
    except ImportError:
        pytest.skip("transformers is not installed: compared with the fixture only")
    reference = BertTokenizer(CHINESE_VOCAB, do_lower_case=False)
    for text in [c["text"] for c in cases]:
        assert chinese.encode(text) == reference.encode(text, add_special_tokens=False), text


# --- end to end


@pytest.mark.e2e
def test_train_dalle_with_the_clip_tokenizer(tmp_path):
    import train_dalle
    import train_vae
    from dalle_pytorch.files import safe_load

    quiet = [*ONE_THREAD, "--num_workers", "0", "--quiet", "--dataset_size", "32", "--batch_size", "4"]
    vae = train_vae.main([*TINY_VAE_MODEL, *quiet, "--steps", "1", "--output_dir", str(tmp_path / "vae")])
    export = train_dalle.main(
        [
            "--vae_path",
            vae,
            *TINY_DALLE_MODEL,
            *quiet,
            "--tokenizer",
            "clip",
            "--steps",
            "2",
            "--sample_every",
            "0",
            "--output_dir",
            str(tmp_path / "dalle"),
        ]
    )
    saved = safe_load(export)
    assert saved["tokenizer"]["kind"] == "clip" and saved["config"]["num_text_tokens"] == 49408
    assert tokenizer_from_dict(saved["tokenizer"]).encode("a red circle") == ClipTokenizer.from_file().encode(
        "a red circle"
    )


if __name__ == "__main__":  # rewrite tests/fixtures/clip_bpe_ids.json from the predecessor's SimpleTokenizer
    import ftfy

    reference = predecessor_simple_tokenizer()
    if reference is None:
        sys.exit(f"no dalle-pytorch 1.6.6 at {PREDECESSOR}: set DALLE_PYTORCH_166 to its unpacked dalle_pytorch/")
    path = os.path.join(FIXTURES, "clip_bpe_ids.json")
    with open(path, encoding="utf-8") as f:
        fixture = json.load(f)
    fixture["ftfy"] = ftfy.__version__
    cases = [{"text": c["text"], "ids": reference.encode(c["text"])} for c in fixture.pop("cases")]
    head = json.dumps(fixture, ensure_ascii=False, indent=1)[:-2]
    body = ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in cases)
    with open(path, "w", encoding="utf-8") as f:
        f.write(f'{head},\n "cases": [\n{body}\n ]\n}}\n')
    print(f"{path}: {len(cases)} captions")
