"""The text tokenizer interface every tokenizer implements (tokenizer.py, clip_bpe.py, chinese.py). Id 0 is
padding in every tokenizer."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

PAD = 0


class Tokenizer(ABC):
    kind: str

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: list[int]) -> str: ...

    @abstractmethod
    def to_dict(self) -> dict:
        """{'kind': ..., 'data': str}: enough to rebuild the tokenizer anywhere."""

    def captions(self, texts: list[str] | str, context_length: int, truncate: bool = True) -> tuple[torch.Tensor, int]:
        """The DALLE's caption input for `texts` and how many were truncated: the ids (b, context_length); a frozen
        encoder's tokenizer bound to its encoder gives the encoder's features (b, context_length, F) instead."""
        return self.tokenize(texts, context_length, truncate)

    def tokenize(self, texts: list[str] | str, context_length: int, truncate: bool = True) -> tuple[torch.Tensor, int]:
        """(b, context_length) long, padded with 0, and how many captions were truncated.

        Ids are checked on the CPU here, so an out-of-range id is a clear error, not a device-side assert.
        """
        if isinstance(texts, str):
            texts = [texts]
        out = torch.zeros(len(texts), context_length, dtype=torch.long)
        truncated = 0
        for i, text in enumerate(texts):
            ids = self.encode(text)
            if len(ids) > context_length:
                if not truncate:
                    raise ValueError(
                        f"caption of {len(ids)} tokens is longer than --text_seq_len {context_length}: "
                        f"raise --text_seq_len or allow --truncate_captions ({text[:60]!r})"
                    )
                ids, truncated = self.cut_to(ids, context_length), truncated + 1
            out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        if out.numel() and (out.min() < 0 or out.max() >= self.vocab_size):
            raise ValueError(
                f"tokenizer produced ids outside [0, {self.vocab_size}): the tokenizer file is inconsistent"
            )
        return out, truncated

    def cut_to(self, ids: list[int], context_length: int) -> list[int]:
        """A caption's ids cut to `context_length`: its first ones."""
        return ids[:context_length]
