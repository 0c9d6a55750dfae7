"""Exports: one self-describing file per trained model (weights, model config, format version) that
generate.py and the evaluation read on any machine, with any backend or none, with `weights_only=True`.

A DALLE export holds its VAE's export and its text tokenizer too; a pretrained image tokenizer (VQGAN,
OpenAI's dVAE) is recorded (kind, config, paths, fingerprint) instead of copied, and read again from its files.
"""

from __future__ import annotations

import os

from ..data.tokenizer import tokenizer_from_dict
from ..files import atomic_save, safe_load
from ..models.dalle import DALLE, DALLEConfig
from ..models.vae import DiscreteVAE, VAEConfig

EXPORT_FORMAT_VERSION = 1


def save_export(path: str, kind: str, config: dict, weights: dict, **extra) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_save(
        {"format_version": EXPORT_FORMAT_VERSION, "kind": kind, "config": config, "weights": weights, **extra}, path
    )


def load_export(path: str, kind: str) -> dict:
    obj = safe_load(path)
    if not isinstance(obj, dict) or "format_version" not in obj or "kind" not in obj:
        raise ValueError(
            f"{path} is not an export of this project (no format_version): pass the vae.pt / dalle.pt that "
            "training wrote, or convert a resume checkpoint with `python -m dalle_pytorch.convert`"
        )
    if obj["kind"] != kind:
        raise ValueError(f"{path} is a {obj['kind']} export, expected a {kind} export")
    if obj["format_version"] > EXPORT_FORMAT_VERSION:
        raise ValueError(
            f"{path} has export format {obj['format_version']}; this code reads up to "
            f"{EXPORT_FORMAT_VERSION}: update the code"
        )
    return obj


def vae_from_export(obj: dict) -> DiscreteVAE:
    """The frozen, eval-mode VAE of an export's dict (a vae.pt, or the `vae` entry of a dalle.pt)."""
    cfg = dict(obj["config"])
    cfg["normalization"] = tuple(tuple(t) for t in cfg["normalization"])
    vae = DiscreteVAE(VAEConfig(**cfg))
    vae.load_state_dict(obj["weights"])
    return vae.eval().requires_grad_(False)


def load_vae(path: str, map_location="cpu") -> tuple[DiscreteVAE, dict]:
    """The frozen, eval-mode VAE stored in an export written by train_vae.py, and the export itself."""
    obj = load_export(path, "vae")
    return vae_from_export(obj).to(map_location), obj


def load_dalle(path: str, device="cpu", vqgan_model_path: str = "", openai_vae_path: str = ""):
    """(dalle, vae, tokenizer) from a DALLE export, in eval mode on `device`. A pretrained image tokenizer is
    read again from the files the export records, or from the given paths if they moved."""
    obj = load_export(path, "dalle")
    dalle = DALLE(DALLEConfig(**obj["config"]))
    dalle.load_state_dict(obj["weights"])
    if obj["vae"]["kind"] == "vae":  # our own VAE, stored in the export
        if vqgan_model_path or openai_vae_path:
            raise ValueError(f"{path} holds its own VAE: --vqgan_model_path and --openai_vae_path do not apply")
        vae = vae_from_export(obj["vae"])
    else:
        from ..models.pretrained import tokenizer_from_record

        vae = tokenizer_from_record(obj["vae"], vqgan_model_path, openai_vae_path)
    return dalle.eval().to(device), vae.to(device), tokenizer_from_dict(obj["tokenizer"])


def load_clip(path: str, device="cpu"):
    """(clip, tokenizer) from a CLIP export written by train_clip.py, in eval mode on `device`."""
    from ..models.clip import CLIP, CLIPConfig

    obj = load_export(path, "clip")
    clip = CLIP(CLIPConfig(**obj["config"]))
    clip.load_state_dict(obj["weights"])
    return clip.eval().to(device), tokenizer_from_dict(obj["tokenizer"])


def dalle_fit(path: str) -> dict:
    """What a CLIP must share with a DALLE export to rank its images: the text tokenizer (as a dict), the
    caption length, the image size and channels (of its VAE, or the pretrained tokenizer's record)."""
    obj = load_export(path, "dalle")
    vae = obj["vae"]
    if vae["kind"] == "vae":
        size, channels = vae["config"]["image_size"], vae["config"]["channels"]
    else:
        size, channels = vae["image_size"], 3
    return {
        "tokenizer": obj["tokenizer"],
        "text_seq_len": obj["config"]["text_seq_len"],
        "image_size": size,
        "channels": channels,
    }


def check_clip_fits(clip, clip_tokenizer, dalle_path: str, clip_path: str) -> None:
    """A CLIP ranks a DALLE's images only if it reads the same captions and images: refuse it otherwise."""
    fit = dalle_fit(dalle_path)
    if clip_tokenizer.to_dict() != fit["tokenizer"]:
        raise ValueError(
            f"--clip_path {clip_path} was trained with another text tokenizer than {dalle_path}: train it with "
            f"`python train_clip.py --dalle_path {dalle_path}`"
        )
    c = clip.cfg
    if (c.image_size, c.channels) != (fit["image_size"], fit["channels"]):
        raise ValueError(
            f"--clip_path {clip_path} reads {c.channels}x{c.image_size}px images, {dalle_path} makes "
            f"{fit['channels']}x{fit['image_size']}px: train it with `python train_clip.py --dalle_path {dalle_path}`"
        )
