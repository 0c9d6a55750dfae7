"""The tokenizer of a frozen pretrained text encoder (T5, CLIP's text tower), as `transformers` saves it beside the
encoder's weights: the captions' ids for --text_encoder. Ids are the encoder's own plus one, so that 0 stays
padding as in every tokenizer here; the encoder (inference/text_encoders.py) takes them back by one."""

from __future__ import annotations

import os

import torch

from .tokenizer_base import Tokenizer

ENCODERS = ("t5", "clip")


def hub_hint(path: str) -> str:
    """What to do when `path` is neither a folder nor in the Hugging Face cache."""
    from huggingface_hub import constants  # where the hub looks (HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME)

    cache = constants.HF_HUB_CACHE
    return (
        f"--text_encoder_path {path}: no such folder, and not in the Hugging Face cache {cache} "
        f"(offline, or no network): run `hf download {path}` where there is a network and copy the cache, "
        "or pass the folder that save_pretrained wrote (config.json, the weights and the tokenizer files)"
    )


def load_hf(loader, path: str):
    """loader(path) from a folder, or by Hugging Face name through its cache (downloaded once); one line if
    neither can be had."""
    try:
        return loader(path)
    except (OSError, ValueError) as e:
        if os.path.isdir(path):
            raise FileNotFoundError(
                f"--text_encoder_path {path}: not a folder transformers' save_pretrained wrote (config.json, the "
                f"weights and the tokenizer files): {str(e).strip().splitlines()[0]}"
            ) from e
        raise FileNotFoundError(hub_hint(path)) from e


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("--text_encoder needs transformers: run `make install`") from e
    transformers.logging.set_verbosity_error()  # its load reports and progress bars: not in a run's output
    transformers.logging.disable_progress_bar()
    return transformers


class EncoderTokenizer(Tokenizer):
    kind = "text_encoder"

    def __init__(self, encoder: str, path: str, fingerprint: str = ""):
        if encoder not in ENCODERS:
            raise ValueError(f"--text_encoder: unknown {encoder!r}; use one of {', '.join(ENCODERS)}")
        if not path:
            raise ValueError(f"--text_encoder {encoder} needs --text_encoder_path (a folder or a Hugging Face name)")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the data workers fork after it loads
        self.encoder, self.path, self.fingerprint = encoder, path, fingerprint
        self.hf = load_hf(_transformers().AutoTokenizer.from_pretrained, path)
        self.pad_id = self.hf.pad_token_id if self.hf.pad_token_id is not None else 0
        self.reader = None  # the frozen encoder, once bound: captions() gives its features

    def bind(self, encoder) -> EncoderTokenizer:
        """Let captions() give `encoder`'s features (inference/text_encoders.py's FrozenTextEncoder)."""
        self.reader = encoder
        return self

    def captions(self, texts, context_length: int, truncate: bool = True) -> tuple[torch.Tensor, int]:
        ids, cut = self.tokenize(texts, context_length, truncate)
        return (ids if self.reader is None else self.reader.features(ids)), cut

    def __getstate__(self):  # the data workers get the tokenizer, never the encoder's weights
        return dict(self.__dict__, reader=None)

    @property
    def vocab_size(self) -> int:
        return len(self.hf) + 1

    def encode(self, text: str) -> list[int]:
        """The encoder's ids of `text` with its special tokens (T5's </s>; CLIP's start and end), plus one."""
        return [i + 1 for i in self.hf(text)["input_ids"]]

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode([i - 1 for i in ids if i > 0], skip_special_tokens=True)

    def to_dict(self) -> dict:
        return dict(kind=self.kind, data="", encoder=self.encoder, path=self.path, fingerprint=self.fingerprint)

    def cut_to(self, ids: list[int], context_length: int) -> list[int]:
        """Cut as the encoder's own tokenizer cuts: a closing special token (T5's </s>, CLIP's end of text) kept."""
        last = ids[-1:] if ids[-1] - 1 in set(self.hf.all_special_ids) else []
        return ids[: context_length - len(last)] + last
