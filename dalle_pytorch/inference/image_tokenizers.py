"""Which image tokenizer the flags choose (train_dalle.py's, the evaluation's, generate.py's record of them): the
project's VAE export, a taming VQGAN or OpenAI's dVAE, pretrained ones downloaded into a cache when no file is
given, with the fingerprint that ties a DALLE's image tokens to it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..compat.downloads import OPENAI_DEFAULT, VQGAN_DEFAULT, default_openai_dir, default_vqgan_paths
from ..config import flag
from ..files import fingerprint
from ..models.pretrained import load_openai, load_vqgan, openai_file
from .load import load_vae


@dataclass
class ImageTokenizerConfig:
    """The flags that choose a DALLE's image tokenizer: train_dalle.py's (DALLERunConfig has them), the encode
    command's, and what a run's config.json records of them (`config.pick(ImageTokenizerConfig, record)`)."""

    vae_path: str = flag(
        "",
        "VAE export written by train_vae.py, or LlamaGen's VQ checkpoint (vq_ds16_t2i.pt; or a pretrained tokenizer: "
        "--taming, --openai_vae_path)",
    )
    taming: bool = flag(False, "tokenize images with a pretrained taming-transformers VQGAN or Gumbel-VQ")
    vqgan_model_path: str = flag("", "--taming: the VQGAN's Lightning checkpoint (.ckpt) or state dict")
    vqgan_config_path: str = flag("", "--taming: the VQGAN's config (.yaml)")
    openai_vae_path: str = flag("", "a folder with OpenAI's dVAE: encoder.pkl + decoder.pkl, or their state dicts .pt")
    pretrained_image_size: int = flag(
        0,
        "image side for a pretrained tokenizer (0: the VQGAN config's resolution; 256 for OpenAI's dVAE and "
        "LlamaGen's VQ)",
    )


def load_image_tokenizer(cfg: ImageTokenizerConfig, data_given: bool = False, say=print):
    """(tokenizer, export or record, fingerprint) of the image tokenizer `cfg` chooses. As in the predecessor, a
    bare --taming uses its default VQGAN and, when the run has data of its own (`data_given`: --image_text_folder),
    no tokenizer flag means OpenAI's dVAE: both downloaded into a cache (compat/downloads.py); `say` tells which
    (one rank of many says it)."""
    vae_path, taming, openai_vae_path = cfg.vae_path, cfg.taming, cfg.openai_vae_path
    vqgan_model_path, vqgan_config_path = cfg.vqgan_model_path, cfg.vqgan_config_path
    image_size = cfg.pretrained_image_size
    if (vqgan_model_path or vqgan_config_path) and not taming:
        raise ValueError("--vqgan_model_path and --vqgan_config_path are read with --taming: add --taming")
    chosen = [
        f for f, on in (("--vae_path", vae_path), ("--taming", taming), ("--openai_vae_path", openai_vae_path)) if on
    ]
    if len(chosen) > 1:
        raise ValueError(f"{' and '.join(chosen)} each choose the image tokenizer: pass only one of them")
    if not chosen and not data_given:
        raise ValueError(
            "--vae_path is required: train a VAE first with `python train_vae.py` and pass its vae.pt, or use a "
            "pretrained tokenizer with --taming --vqgan_model_path M --vqgan_config_path C, or --openai_vae_path DIR; "
            "with --image_text_folder and none of these, OpenAI's dVAE is downloaded (the predecessor's default)"
        )
    if image_size < 0:
        raise ValueError(f"--pretrained_image_size must be positive, or 0 for the tokenizer's own (got {image_size})")
    if vae_path:
        vae, export = load_vae(vae_path, image_size=image_size)
    elif taming:
        vae, export = _load_taming(vqgan_model_path, vqgan_config_path, image_size)
    else:
        vae, export = _load_openai(openai_vae_path, image_size, say)
    return vae, export, tokenizer_fingerprint(export)


def tokenizer_fingerprint(export: Mapping) -> str:
    """The fingerprint of an image tokenizer from our VAE's export, or the one a pretrained tokenizer's record keeps."""
    return fingerprint(export["config"], export["weights"]) if export["kind"] == "vae" else export["fingerprint"]


def _load_taming(model_path: str, config_path: str, image_size: int):
    if bool(model_path) != bool(config_path):
        raise ValueError(
            "--taming needs --vqgan_model_path (.ckpt) and --vqgan_config_path (.yaml) together, or neither for "
            "the predecessor's default VQGAN (vqgan_imagenet_f16_1024, downloaded)"
        )
    if model_path:
        return load_vqgan(model_path, config_path, image_size)
    try:
        model_path, config_path = default_vqgan_paths()
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"--taming needs --vqgan_model_path and --vqgan_config_path, or its default VQGAN downloaded: {e}"
        ) from None
    vae, record = load_vqgan(model_path, config_path, image_size)
    record["downloaded"] = {"vqgan_model_path": [VQGAN_DEFAULT[0]]}  # so that generate.py can fetch it again
    return vae, record


def _load_openai(directory: str, image_size: int, say):
    """OpenAI's dVAE from DIR, or downloaded: with no DIR, or a DIR that holds neither of its files."""
    if directory and _has_openai_files(directory):
        return load_openai(directory, image_size)
    if not directory:
        say(
            "no --vae_path: using OpenAI's pretrained dVAE, the predecessor's default (pass --vae_path to use your own)"
        )
        what = "OpenAI's dVAE, the default without --vae_path,"
    elif not os.path.isdir(directory):
        raise FileNotFoundError(f"--openai_vae_path {directory} is not a directory holding encoder.pkl and decoder.pkl")
    else:
        say(f"--openai_vae_path {directory} holds no encoder.pkl or decoder.pkl: using OpenAI's, downloaded")
        what = f"--openai_vae_path {directory} holds no encoder.pkl and decoder.pkl, and OpenAI's"
    try:
        directory = default_openai_dir()
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{what} could not be downloaded: {e}") from None
    vae, record = load_openai(directory, image_size)
    record["downloaded"] = {"openai_vae_path": list(OPENAI_DEFAULT)}  # so that generate.py can fetch them again
    return vae, record


def _has_openai_files(directory: str) -> bool:
    """Any encoder or decoder file: one without the other is the loader's error to report, not a download."""
    return any(openai_file(directory, part) for part in ("encoder", "decoder"))


def tokenizer_flag(cfg: ImageTokenizerConfig, dalle_path: str = "") -> str:
    """The flags that chose the image tokenizer (or the --dalle_path whose tokenizer it is), for messages."""
    if cfg.taming and not cfg.vqgan_model_path:
        return "--taming (the predecessor's default VQGAN, downloaded)"
    if cfg.taming:
        return f"--taming --vqgan_model_path {cfg.vqgan_model_path}"
    if cfg.openai_vae_path:
        return f"--openai_vae_path {cfg.openai_vae_path}"
    if not cfg.vae_path and dalle_path:
        return f"the image tokenizer of --dalle_path {dalle_path}"
    if not cfg.vae_path:
        return "OpenAI's dVAE (the default without --vae_path, downloaded)"
    return f"--vae_path {cfg.vae_path}"
