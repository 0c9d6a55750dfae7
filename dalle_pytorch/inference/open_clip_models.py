"""Published CLIPs (OpenAI's, LAION's) through open_clip for reranking and the CLIP score, where published work
scores with them rather than with a CLIP trained on one's own small data. `--clip_path` takes, besides an export
of train_clip.py:

    ViT-B-32:openai                     a model name and its pretrained tag (open_clip.list_pretrained())
    ViT-L-14:laion2b_s32b_b82k
    hf-hub:laion/CLIP-ViT-B-32-laion2B-s34B-b79K
    ViT-B-32:/models/open_clip_vit_b_32.bin     a model name and a local file of its weights (offline machines)

Downloads go through open_clip, which fetches from the Hugging Face Hub into its cache (HF_HUB_OFFLINE=1 reads the
cache alone). The model is open_clip's own, frozen and in eval mode, behind the scoring interface of our CLIP:
captions as text, tokenized by the model's tokenizer; images in [0, 1] of any side, resized (bicubic, antialiased)
to the model's and normalized with its mean and std, as its preprocessing does."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


def is_open_clip_name(path: str) -> bool:
    """Whether --clip_path names an open_clip model rather than a file of ours."""
    if path.startswith("hf-hub:"):
        return True
    if os.path.exists(path) or ":" not in path:
        return False
    return path.split(":", 1)[0] in _open_clip().list_models()


def _open_clip():
    try:
        import open_clip
    except ImportError:
        raise ImportError("--clip_path MODEL:TAG needs open_clip: run `make install` (open_clip_torch)") from None
    return open_clip


class OpenCLIPTokenizer:
    """The model's tokenizer with ours' tokenize(): (ids (b, context), how many captions were cut)."""

    def __init__(self, tokenize, name: str):
        self._tokenize, self.name = tokenize, name

    def tokenize(self, texts, context_length: int, truncate: bool = True) -> tuple[torch.Tensor, int]:
        texts = [texts] if isinstance(texts, str) else list(texts)
        return self._tokenize(texts, context_length=context_length), 0

    def to_dict(self) -> dict:
        return {"kind": "open_clip", "name": self.name}


class PretrainedCLIP(nn.Module):
    """An open_clip model behind CLIP's scoring interface (embed_text, embed_image, score); `pretrained` tells
    the fit check that it reads any caption and image size."""

    pretrained = True

    def __init__(self, model: nn.Module, name: str, tokenizer: OpenCLIPTokenizer, preprocess: dict):
        """`preprocess`: open_clip's preprocessing config of the model (size, mean, std)."""
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.name = name
        self.tokenizer = tokenizer
        size = preprocess["size"]
        size = size if isinstance(size, int) else size[0]
        self.register_buffer("mean", torch.tensor(preprocess["mean"]).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(preprocess["std"]).view(1, 3, 1, 1), persistent=False)
        self.cfg = SimpleNamespace(text_seq_len=int(model.context_length), image_size=size, channels=3)

    def embed_text(self, text: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.model.encode_text(text).float(), dim=-1)

    def embed_image(self, images: torch.Tensor) -> torch.Tensor:
        """(b, 3, s, s) in [0, 1], any s -> (b, d), unit norm."""
        size = self.cfg.image_size
        if images.shape[-1] != size or images.shape[-2] != size:
            images = F.interpolate(images.float(), size=(size, size), mode="bicubic", antialias=True).clamp(0, 1)
        x = (images.float() - self.mean) / self.std
        return F.normalize(self.model.encode_image(x.to(self.mean.dtype)).float(), dim=-1)

    @torch.no_grad()
    def score(self, text: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        return (self.embed_text(text) * self.embed_image(images)).sum(-1)

    def describe(self) -> dict:
        """What results.json says of the CLIP that scored."""
        return {"kind": "open_clip", "name": self.name}


def load_open_clip(path: str, device="cpu") -> tuple[PretrainedCLIP, OpenCLIPTokenizer]:
    """(clip, tokenizer) of an open_clip name as --clip_path takes it (see the module's docstring)."""
    open_clip = _open_clip()
    if path.startswith("hf-hub:"):
        model_name, pretrained = path, None
    else:
        model_name, pretrained = path.split(":", 1)
        if os.path.sep in pretrained or pretrained.endswith((".bin", ".pt", ".pth", ".safetensors")):
            if not os.path.exists(pretrained):
                raise FileNotFoundError(f"--clip_path {path}: {pretrained} does not exist")
        elif pretrained not in open_clip.list_pretrained_tags_by_model(model_name):
            tags = ", ".join(open_clip.list_pretrained_tags_by_model(model_name)) or "none"
            raise ValueError(f"--clip_path {path}: open_clip has no {pretrained!r} weights for {model_name} ({tags})")
    try:
        model = open_clip.create_model(model_name, pretrained=pretrained, device=device)
    except (RuntimeError, OSError) as e:  # a download refused offline, a file of another model
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"--clip_path {path} could not be loaded ({first[:200]}): offline, download it once where the Hub is "
            "reachable (it lands in the Hugging Face cache), or pass MODEL:/path/to/weights"
        ) from None
    tokenizer = OpenCLIPTokenizer(open_clip.get_tokenizer(model_name), path)
    clip = PretrainedCLIP(model, path, tokenizer, open_clip.get_model_preprocess_cfg(model))
    return clip.to(device), tokenizer
