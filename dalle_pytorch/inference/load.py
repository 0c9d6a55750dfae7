"""The models an export holds, built and loaded in eval mode: VAE, DALLE (with its image and text tokenizers),
CLIP; and where a DALLE run started from."""

from __future__ import annotations

import torch

from ..data.tokenizer import tokenizer_from_dict
from ..models.dalle import DALLE, DALLEConfig
from ..models.vae import DiscreteVAE, VAEConfig
from ..models.vq_tokenizer import VQTokenizer, VQTokenizerConfig
from .export import export_weights, load_export
from .published import llamagen_dalle_export, llamagen_kind


def pick_device(name: str = "") -> torch.device:
    """The --device flag's device: `name` (cpu, cuda, cuda:1 ...), or cuda when available, else cpu."""
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def vae_from_export(obj: dict) -> DiscreteVAE | VQTokenizer:
    """The frozen, eval-mode VAE of an export's dict (a vae.pt, or the `vae` entry of a dalle.pt), with its
    moving average of the weights where it has one: the same weights wherever the export is read."""
    cfg = dict(obj["config"])
    if cfg.pop("model", "dvae") == "vqgan":  # train_vae.py --model vqgan
        vae = VQTokenizer(VQTokenizerConfig(**cfg))
    else:
        cfg["normalization"] = tuple(tuple(t) for t in cfg["normalization"])
        vae = DiscreteVAE(VAEConfig(**cfg))
    vae.load_state_dict(export_weights(obj))
    return vae.eval().requires_grad_(False)


def load_vae(path: str, map_location="cpu", image_size: int = 0) -> tuple[DiscreteVAE | VQTokenizer, dict]:
    """The frozen, eval-mode VAE (a dVAE or a VQGAN) stored in an export written by train_vae.py, or LlamaGen's VQ
    (tokenizing `image_size` images, 256 by default), and the export."""
    obj = load_export(path, "vae", image_size=image_size)
    return vae_from_export(obj).to(map_location), obj


def load_dalle(
    path: str,
    device="cpu",
    vqgan_model_path: str = "",
    openai_vae_path: str = "",
    predecessor: dict | None = None,
    weights: str = "auto",
    text_encoder_path: str = "",
):
    """(dalle, vae, tokenizer) from a DALLE export, in eval mode on `device`. A pretrained image tokenizer is
    read again from the files the export records, or from the given paths if they moved. `predecessor`: how
    to read a predecessor's checkpoint (load_export). `weights`: auto (the EMA where the run kept one), ema, raw.
    A DALLE that reads a frozen text encoder: its tokenizer comes bound to the encoder (`tokenizer.captions` gives
    features), loaded from the recorded path or `text_encoder_path` and checked against the recorded fingerprint."""
    if llamagen_kind(path):  # LlamaGen's GPT file: its VQ and encoder where LlamaGen keeps them (published.py)
        obj = llamagen_dalle_export(path, "", text_encoder_path, device=device)
        vae = vae_from_export(obj["vae"])
    else:
        obj, vae = read_dalle(path, vqgan_model_path, openai_vae_path, predecessor)
    dalle = DALLE(DALLEConfig(**obj["config"]))
    dalle.load_state_dict(export_weights(obj, weights, path))
    if obj["tokenizer"]["kind"] == "text_encoder":
        from .text_encoders import load_text_encoder

        tokenizer, _ = load_text_encoder(obj["tokenizer"], device, text_encoder_path)
    else:
        if text_encoder_path:
            raise ValueError(f"--text_encoder_path: {path} reads captions through its own tokenizer, not an encoder")
        tokenizer = tokenizer_from_dict(obj["tokenizer"])
    return dalle.eval().to(device), vae.to(device), tokenizer


def read_dalle(
    path: str, vqgan_model_path: str = "", openai_vae_path: str = "", predecessor: dict | None = None, say=print
):
    """(export, frozen image tokenizer) of a DALLE export: our VAE from the export, a pretrained one from the
    files it records (or the given paths)."""
    obj = load_export(path, "dalle", predecessor, say)
    if obj["vae"]["kind"] == "vae":  # our own VAE, stored in the export
        if vqgan_model_path or openai_vae_path:
            raise ValueError(f"{path} holds its own VAE: --vqgan_model_path and --openai_vae_path do not apply")
        return obj, vae_from_export(obj["vae"])
    from ..compat.downloads import refetch_downloaded
    from ..models.pretrained import tokenizer_from_record

    if not (vqgan_model_path or openai_vae_path):  # a downloaded default gone from this machine: fetch it again
        found = refetch_downloaded(obj["vae"])
        vqgan_model_path, openai_vae_path = found.get("vqgan_model_path", ""), found.get("openai_vae_path", "")
    return obj, tokenizer_from_record(obj["vae"], vqgan_model_path, openai_vae_path)


def load_clip(path: str, device="cpu"):
    """(clip, tokenizer) from a CLIP export written by train_clip.py, in eval mode on `device` (its EMA where it
    has one), or a published CLIP through open_clip (ViT-B-32:openai, hf-hub:..., MODEL:FILE: open_clip_models.py)."""
    from ..models.clip import CLIP, CLIPConfig
    from .open_clip_models import is_open_clip_name, load_open_clip

    if is_open_clip_name(path):
        return load_open_clip(path, device)

    obj = load_export(path, "clip")
    clip = CLIP(CLIPConfig(**obj["config"]))
    clip.load_state_dict(export_weights(obj, "auto", path))
    return clip.eval().to(device), tokenizer_from_dict(obj["tokenizer"])
