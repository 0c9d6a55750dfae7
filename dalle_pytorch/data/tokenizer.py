"""Text tokenizers behind one interface: a plain byte tokenizer, YouTokenToMe BPE, Hugging Face JSON, and the
predecessor's two (OpenAI CLIP's BPE in clip_bpe.py, bert-base-chinese's WordPiece in chinese.py).

Id 0 is padding in every tokenizer. A tokenizer serializes to a small dict of strings that goes into the
run directory and the DALLE export, so generation always uses the tokenizer training used.
"""

from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager

from .chinese import ChineseTokenizer
from .clip_bpe import ClipTokenizer
from .tokenizer_base import PAD, Tokenizer


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes shifted by one (0 is padding): no training, any text."""

    kind = "byte"

    @property
    def vocab_size(self) -> int:
        return 257

    def encode(self, text: str) -> list[int]:
        return [b + 1 for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - 1 for i in ids if 0 < i < 257).decode("utf-8", errors="replace")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "data": ""}


class YttmTokenizer(Tokenizer):
    """Byte-level BPE from YouTokenToMe (pad 0, unk 1, bos 2, eos 3). Text is lowercased for the run's own BPE
    (trained on lowercased captions), not for a model given with --bpe_path or converted from the predecessor."""

    kind = "yttm"

    def __init__(self, model_text: str, lowercase: bool = True):
        import youtokentome as yttm

        self.model_text = model_text
        self.lowercase = lowercase
        with tempfile.NamedTemporaryFile("w", suffix=".yttm", delete=False) as f:
            f.write(model_text)
        try:
            self.bpe = yttm.BPE(model=f.name)
        finally:
            os.unlink(f.name)

    @classmethod
    def from_file(cls, path: str, lowercase: bool = True) -> YttmTokenizer:
        if not os.path.exists(path):
            raise FileNotFoundError(f"--bpe_path {path} does not exist")
        with open(path) as f:
            return cls(f.read(), lowercase)

    @classmethod
    def train(cls, captions: list[str], vocab_size: int, path: str) -> YttmTokenizer:
        """Train a BPE on `captions` and save it to `path`."""
        import youtokentome as yttm

        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write("\n".join(c.lower() for c in captions))
        try:
            with _stdout_silenced():  # its C++ writes ~20 lines of progress to the process's stdout
                yttm.BPE.train(data=f.name, model=path, vocab_size=vocab_size, n_threads=1)
        finally:
            os.unlink(f.name)
        return cls.from_file(path)

    @property
    def vocab_size(self) -> int:
        return self.bpe.vocab_size()

    def encode(self, text: str) -> list[int]:
        import youtokentome as yttm

        return self.bpe.encode([text.lower() if self.lowercase else text], output_type=yttm.OutputType.ID)[0]

    def decode(self, ids: list[int]) -> str:
        return self.bpe.decode([[i for i in ids if i != PAD]], ignore_ids=[PAD])[0]

    def to_dict(self) -> dict:
        return {"kind": self.kind, "data": self.model_text, **({} if self.lowercase else {"lowercase": False})}


class HugTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` JSON file; ids are shifted by `offset` (1) so that 0 stays padding. A converted
    predecessor model has offset 0: it used the file's ids as they are (and 0 as padding too)."""

    kind = "hug"

    def __init__(self, json_text: str, offset: int = 1):
        from tokenizers import Tokenizer as HFTokenizer

        self.json_text = json_text
        self.offset = offset
        self.tok = HFTokenizer.from_str(json_text)
        if offset == 0:  # the predecessor replaced the file's post-processor (no added special tokens)
            from tokenizers.processors import ByteLevel

            self.tok.post_processor = ByteLevel(trim_offsets=True)

    @classmethod
    def from_file(cls, path: str, offset: int = 1) -> HugTokenizer:
        if not os.path.exists(path):
            raise FileNotFoundError(f"--bpe_path {path} does not exist")
        with open(path) as f:
            return cls(f.read(), offset)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size() + self.offset

    def encode(self, text: str) -> list[int]:
        return [i + self.offset for i in self.tok.encode(text).ids]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode([i - self.offset for i in ids if i > 0])

    def to_dict(self) -> dict:
        return {"kind": self.kind, "data": self.json_text, **({} if self.offset == 1 else {"offset": self.offset})}


def _clip(data: str) -> Tokenizer:

    return ClipTokenizer(data)


def _chinese(data: str) -> Tokenizer:

    return ChineseTokenizer(data)


def tokenizer_from_dict(d: dict, text_encoder_path: str = "") -> Tokenizer:
    """The tokenizer a record (an export's, a run's) describes; a frozen encoder's from `text_encoder_path` when
    given (where it lives on this machine), else from the recorded path."""
    if d.get("kind") == "text_encoder":
        from .encoder_tokenizer import EncoderTokenizer

        return EncoderTokenizer(d["encoder"], text_encoder_path or d["path"], d.get("fingerprint", ""))
    kinds = {
        "byte": lambda _: ByteTokenizer(),
        "yttm": YttmTokenizer,
        "hug": HugTokenizer,
        "clip": _clip,
        "chinese": _chinese,
    }
    if d.get("kind") not in kinds:
        raise ValueError(
            f"unknown tokenizer kind {d.get('kind')!r}: expected one of {sorted([*kinds, 'text_encoder'])}"
        )
    options = {k: v for k, v in d.items() if k in ("lowercase", "offset")}  # a converted predecessor's variants
    return kinds[d["kind"]](d["data"], **options)


@contextmanager
def _stdout_silenced():
    """File descriptor 1 to /dev/null meanwhile (what C++ code prints does not pass through sys.stdout)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
