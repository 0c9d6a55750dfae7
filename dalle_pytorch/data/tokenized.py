"""Captions as token ids, in the data workers: (image, caption) -> (image, caption ids (text_seq_len,)).

Truncated captions are counted across workers (a shared counter) so the trainer can report them. With
--precompute_tokens the images are VAE codes computed once before training (PrecomputedTokens).
"""

from __future__ import annotations

import multiprocessing

import torch

from .stream import Stream, is_stream
from .tokenizer import Tokenizer


def _counter(start: int = 0):
    return multiprocessing.get_context("fork").Value("i", start)


class TokenizedCaptions(torch.utils.data.Dataset):
    def __init__(self, base, tokenizer: Tokenizer, text_seq_len: int, truncate: bool = True):
        self.base, self.tokenizer, self.text_seq_len, self.truncate = base, tokenizer, text_seq_len, truncate
        self.truncated = _counter()

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index):
        return self.tokenize(*self.base[index])

    def tokenize(self, image, caption):
        """(image, caption ids (T,)); a caption read as cached encoder features (length, dim) comes back as
        (T, dim), zero vectors after its real tokens (the DALLE's padding), the encoder never run."""
        if isinstance(caption, torch.Tensor):
            return image, self._padded(caption)
        ids, cut = self.tokenizer.tokenize(caption, self.text_seq_len, self.truncate)
        if cut:
            with self.truncated.get_lock():
                self.truncated.value += cut
        return image, ids[0]

    def _padded(self, features: torch.Tensor) -> torch.Tensor:
        n = features.shape[0]
        if n > self.text_seq_len:
            if not self.truncate:
                raise ValueError(
                    f"cached caption features of {n} tokens: longer than --text_seq_len {self.text_seq_len}"
                )
            with self.truncated.get_lock():
                self.truncated.value += 1
            features = features[: self.text_seq_len]
        return torch.nn.functional.pad(features, (0, 0, 0, self.text_seq_len - features.shape[0]))


class TokenizedStream(torch.utils.data.IterableDataset):
    """The streamed (WebDataset) counterpart of TokenizedCaptions: a Stream (data/stream.py) that answers for the
    one it wraps, and passes what is not a sample (a skipped one's None, a worker's error) through."""

    def __init__(self, base: Stream, tokenizer: Tokenizer, text_seq_len: int, truncate: bool = True):
        self.base = base
        self._tok = TokenizedCaptions([], tokenizer, text_seq_len, truncate)
        self.truncated = self._tok.truncated

    @property
    def num_samples(self) -> int:
        return self.base.num_samples

    @property
    def order_id(self) -> str:
        return self.base.order_id

    @property
    def num_skipped(self) -> int:
        return self.base.num_skipped

    def set_plan(self, plan) -> None:
        self.base.set_plan(plan)

    def data_counts(self) -> dict[str, int]:
        return self.base.data_counts()

    def captions(self, limit: int) -> list[str]:
        return self.base.captions(limit)

    def describe(self) -> str:
        return self.base.describe()

    def __iter__(self):
        for item in self.base:
            yield self._tok.tokenize(*item) if isinstance(item, tuple) else item


def tokenized(dataset, tokenizer: Tokenizer, text_seq_len: int):
    """The dataset with its captions tokenized, streamed or indexed like `dataset`."""
    wrap = TokenizedStream if is_stream(dataset) else TokenizedCaptions
    return wrap(dataset, tokenizer, text_seq_len)


class PrecomputedTokens(torch.utils.data.Dataset):
    """(image token ids, caption ids) of every sample, from one VAE pass over the data before training.

    Training then skips image decoding, augmentation and the VAE; the price is a fixed crop per image and
    one caption line per image, drawn once."""

    def __init__(self, image_tokens: torch.Tensor, text: torch.Tensor, truncated: int = 0):
        self.image_tokens, self.text = image_tokens, text
        self.truncated = _counter(truncated)

    def __len__(self) -> int:
        return len(self.text)

    def __getitem__(self, index):
        return self.image_tokens[index], self.text[index]


@torch.no_grad()
def precompute_tokens(dataset: TokenizedCaptions, vae, batch_size: int = 256) -> PrecomputedTokens:
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size)
    device = next(vae.parameters()).device
    images, texts = [], []
    for image, text in loader:
        images.append(vae.get_codebook_indices(image.to(device).float()).cpu())
        texts.append(text)
    return PrecomputedTokens(torch.cat(images), torch.cat(texts), dataset.truncated.value)
