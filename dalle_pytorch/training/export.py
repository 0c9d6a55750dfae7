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
