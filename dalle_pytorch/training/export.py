"""Exports: one self-describing file per trained model (weights, model config, format version) that
generate.py and the evaluation read on any machine, with any backend or none, with `weights_only=True`.

A DALLE export holds its VAE's export and its text tokenizer too; a pretrained image tokenizer (VQGAN,
OpenAI's dVAE) is recorded (kind, config, paths, fingerprint) instead of copied, and read again from its files.
"""

from __future__ import annotations

import os

from distributed import topology_from_env

from ..data.tokenizer import tokenizer_from_dict
from ..files import atomic_save, fingerprint, safe_load
from ..models.dalle import DALLE, DALLEConfig
from ..models.vae import DiscreteVAE, VAEConfig
from .downloads import cache_root
from .reference import dalle_parts, is_reference, reference_text_tokenizer, vae_parts

EXPORT_FORMAT_VERSION = 1


def save_export(path: str, kind: str, config: dict, weights: dict, **extra) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_save(
        {"format_version": EXPORT_FORMAT_VERSION, "kind": kind, "config": config, "weights": weights, **extra}, path
    )


def load_export(path: str, kind: str, reference: dict | None = None) -> dict:
    """The export at `path`, or a checkpoint of lucidrains' dalle-pytorch 1.6 converted in memory; `reference`:
    the predecessor's flags that say how to read its DALLE (bpe_path, hug, chinese, vqgan_config_path)."""
    obj = safe_load(path)
    if is_reference(obj) and kind in ("vae", "dalle"):
        if topology_from_env().rank == 0:
            print(
                f"{path}: a dalle-pytorch 1.6 {kind} checkpoint, converted on the fly "
                f"(`python -m dalle_pytorch.convert --from_reference {path} --out NEW.pt` converts it once)"
            )
        return from_reference(obj, path, kind, **(reference or {}))
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


def from_reference(
    obj: dict, path: str, kind: str, bpe_path: str = "", hug: bool = False, chinese: bool = False,
    vqgan_config_path: str = "", files_dir: str = "",
) -> dict:  # fmt: skip
    """Our export (as load_export returns it) from a checkpoint the predecessor wrote. A pretrained image
    tokenizer inside its DALLE is written as state dicts to `files_dir` (default: a cache folder per file)."""
    if not isinstance(obj["weights"], dict):  # its DeepSpeed runs' auxiliary.pt holds a note instead
        raise ValueError(
            f"{path} holds no weights (a DeepSpeed checkpoint's auxiliary file): consolidate the DeepSpeed "
            "checkpoint into one dalle.pt first, as dalle-pytorch's wiki 'DeepSpeed-Checkpoints' describes"
        )
    if "vae_params" not in obj:  # its train_vae.py's vae.pt
        if kind != "vae":
            raise ValueError(f"{path} is a dalle-pytorch VAE checkpoint, expected a DALLE: pass it as --vae_path")
        config, weights = vae_parts(obj, path)
        return {"format_version": EXPORT_FORMAT_VERSION, "kind": "vae", "config": config, "weights": weights}
    if kind != "dalle":
        raise ValueError(f"{path} is a dalle-pytorch DALLE checkpoint, expected a {kind}: pass it as --dalle_path")
    if not files_dir:  # named by its image tokenizer's weights: the same tokenizer is written once
        vae_weights = {k: v for k, v in obj["weights"].items() if k.startswith("vae.")}
        files_dir = os.path.join(cache_root(), "converted", fingerprint({}, vae_weights))
    text_tokenizer = reference_text_tokenizer(bpe_path, hug, chinese)
    parts = dalle_parts(obj, path, text_tokenizer, files_dir, vqgan_config_path)
    return {"format_version": EXPORT_FORMAT_VERSION, "kind": "dalle", **parts}


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


def load_dalle(
    path: str, device="cpu", vqgan_model_path: str = "", openai_vae_path: str = "", reference: dict | None = None
):
    """(dalle, vae, tokenizer) from a DALLE export, in eval mode on `device`. A pretrained image tokenizer is
    read again from the files the export records, or from the given paths if they moved. `reference`: how to
    read a predecessor's checkpoint (load_export)."""
    obj, vae = read_dalle(path, vqgan_model_path, openai_vae_path, reference)
    dalle = DALLE(DALLEConfig(**obj["config"]))
    dalle.load_state_dict(obj["weights"])
    return dalle.eval().to(device), vae.to(device), tokenizer_from_dict(obj["tokenizer"])


def start_of(flags) -> tuple[dict, object]:
    """(export, image tokenizer) of the --dalle_path a DALLE run started from, read as train_dalle.py read it
    (`flags`: its parsed flags, or the `dalle` section of its config.json)."""
    # the predecessor's dalle.pt does not say which text tokenizer it used: its flags do (our exports carry theirs)
    reference = {
        "bpe_path": flags["bpe_path"],
        "hug": flags["hug"],
        "chinese": flags["tokenizer"] == "chinese",
        "vqgan_config_path": flags["vqgan_config_path"],
    }
    return read_dalle(flags["dalle_path"], flags["vqgan_model_path"], flags["openai_vae_path"], reference)


def read_dalle(path: str, vqgan_model_path: str = "", openai_vae_path: str = "", reference: dict | None = None):
    """(export, frozen image tokenizer) of a DALLE export: our VAE from the export, a pretrained one from the
    files it records (or the given paths)."""
    obj = load_export(path, "dalle", reference)
    if obj["vae"]["kind"] == "vae":  # our own VAE, stored in the export
        if vqgan_model_path or openai_vae_path:
            raise ValueError(f"{path} holds its own VAE: --vqgan_model_path and --openai_vae_path do not apply")
        return obj, vae_from_export(obj["vae"])
    from ..models.pretrained import tokenizer_from_record
    from .downloads import refetch_downloaded

    if not (vqgan_model_path or openai_vae_path):  # a downloaded default gone from this machine: fetch it again
        found = refetch_downloaded(obj["vae"])
        vqgan_model_path, openai_vae_path = found.get("vqgan_model_path", ""), found.get("openai_vae_path", "")
    return obj, tokenizer_from_record(obj["vae"], vqgan_model_path, openai_vae_path)


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
