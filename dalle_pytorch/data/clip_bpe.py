"""OpenAI CLIP's byte-level BPE (`--tokenizer clip`): the default text tokenizer of lucidrains' DALLE-pytorch
1.6.6 (its `dalle_pytorch/tokenizer.py` SimpleTokenizer, copied from openai/CLIP `clip/simple_tokenizer.py`).

Ids equal SimpleTokenizer's for the same text, so a DALLE converted from the predecessor reads its captions the
same way: 256 byte symbols, the same 256 with the end-of-word mark `</w>`, 48894 merges, then <|startoftext|>
(49406) and <|endoftext|> (49407): 49408 ids. The vocabulary ships as bpe_simple_vocab_16e6.txt.gz beside this
file (MIT, see LICENSE-CLIP-BPE).

Id 0 collides: in CLIP's vocabulary it is the byte '!' without `</w>`, which a word like "!$" or "hi!~" produces,
and it is also padding here, as it was in the predecessor (its tokenize() padded with 0 and its DALLE replaced
every 0 with a per-position padding id). The ids are kept anyway: converted checkpoints must see the ids they
were trained on, and such a '!' was already padding to the predecessor's model. decode() drops it.
"""

from __future__ import annotations

import gzip
import html
import os

from .tokenizer_base import PAD, Tokenizer

BUNDLED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bpe_simple_vocab_16e6.txt.gz")
# SimpleTokenizer reads the header line and the first 49152 - 256 - 2 merges: 256 bytes x 2 + 48894 merges + 2
# special tokens = 49408 ids. The file has 262144 merges; the rest were never used.
NUM_LINES = 1 + 49152 - 256 - 2
START, END = "<|startoftext|>", "<|endoftext|>"
PATTERN = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
CACHE_LIMIT = 100_000  # words; the predecessor's cache grew without bound over a long caption stream


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 bytes to printable characters (whitespace and control bytes move to
    256+), so a BPE over characters is a BPE over bytes. Its order is the order of the first 256 ids."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _pairs(word: tuple[str, ...]) -> set[tuple[str, str]]:
    return set(zip(word, word[1:]))


def read_merges(path: str) -> str:
    """The lines SimpleTokenizer reads from a CLIP vocabulary file, plain or gzipped, as one string."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"--bpe_path {path} does not exist: give a CLIP BPE file (bpe_simple_vocab_16e6.txt)")
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    return "\n".join(lines[:NUM_LINES])


class ClipTokenizer(Tokenizer):
    """CLIP's BPE: ftfy + double HTML unescape, whitespace collapsed, lower case, CLIP's word regex, byte-level BPE."""

    kind = "clip"

    def __init__(self, merges_text: str):
        try:
            import ftfy
            import regex
        except ImportError as e:
            raise ImportError(f"--tokenizer clip needs ftfy and regex ({e}): run `make install`") from e
        self._fix_text, self._spaces = ftfy.fix_text, regex.compile(r"\s+")  # no module attribute: pickles
        self.merges_text = merges_text
        # the header line is skipped as SimpleTokenizer skips it; blank lines only end a short custom file
        merges = [tuple(line.split()) for line in merges_text.split("\n")[1:NUM_LINES] if line.strip()]
        if any(len(m) != 2 for m in merges):
            raise ValueError("--bpe_path is not a CLIP BPE file: every line after the first must be two symbols")
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        vocab = list(self.byte_encoder.values())
        vocab += [v + "</w>" for v in vocab]
        vocab += ["".join(m) for m in merges] + [START, END]
        self.encoder = {piece: i for i, piece in enumerate(vocab)}
        self.decoder = vocab
        self.bpe_ranks = {m: i for i, m in enumerate(merges)}
        self.specials = {self.encoder[START], self.encoder[END]}
        self.cache: dict[str, list[str]] = {}
        self.pat = regex.compile(PATTERN, regex.IGNORECASE)

    @classmethod
    def from_file(cls, path: str = "") -> ClipTokenizer:
        """The bundled vocabulary, or a CLIP-format file of one's own (`--bpe_path`)."""
        return cls(read_merges(path or BUNDLED))

    @property
    def vocab_size(self) -> int:
        return len(self.decoder)  # 49408 with CLIP's file

    def _bpe(self, token: str) -> list[str]:
        """SimpleTokenizer.bpe: merge the lowest-ranked adjacent pair until none is in the merges."""
        if token in (START, END):
            return [token]
        if token in self.cache:
            return self.cache[token]
        word = (*token[:-1], token[-1] + "</w>")
        pairs = _pairs(word)
        while pairs:
            first, second = min(pairs, key=lambda p: self.bpe_ranks.get(p, float("inf")))
            if (first, second) not in self.bpe_ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
            pairs = _pairs(word)
        if len(self.cache) >= CACHE_LIMIT:
            self.cache.clear()
        self.cache[token] = list(word)
        return self.cache[token]

    def _clean(self, text: str) -> str:
        # SimpleTokenizer's basic_clean then whitespace_clean; unescaped twice: captions scraped from HTML are
        # often escaped twice ("&amp;amp;")
        text = html.unescape(html.unescape(self._fix_text(text))).strip()
        return self._spaces.sub(" ", text).strip().lower()

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in self.pat.findall(self._clean(text)):
            chars = "".join(self.byte_encoder[b] for b in word.encode("utf-8"))
            ids.extend(self.encoder[piece] for piece in self._bpe(chars))
        return ids

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`; padding, <|startoftext|>, <|endoftext|> and ids outside the vocabulary are left out.

        Unlike the predecessor's decode, which meant to drop <|endoftext|> but wrote 40407 for 49407
        (`token not in (49406, 40407, 0)`): it kept "<|endoftext|>" in the text and dropped the word "berwick"
        (id 40407). It also raised KeyError on an id outside the vocabulary (its DALLE's per-position padding
        ids) unless the caller passed them as pad_tokens, and left a trailing space."""
        out = bytearray()
        for i in ids:
            if i == PAD or i in self.specials or not 0 <= i < len(self.decoder):
                continue
            piece = self.decoder[i]
            word_end = piece.endswith("</w>")
            out += bytes(self.byte_decoder[c] for c in (piece[:-4] if word_end else piece))
            if word_end:
                out += b" "
        return out.decode("utf-8", errors="replace").strip()

    def to_dict(self) -> dict:
        # the merges SimpleTokenizer reads (about 0.5 MB), so an export needs no file beside it
        return {"kind": self.kind, "data": self.merges_text}
