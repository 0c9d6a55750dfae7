"""Exports: one self-describing file per trained model (weights, model config, format version) that
generate.py and the evaluation read on any machine, with any backend or none, with `weights_only=True`.

A DALLE export holds its VAE's export and its text tokenizer too; a pretrained image tokenizer (VQGAN,
OpenAI's dVAE) is recorded (kind, config, paths, fingerprint) instead of copied, and read again from its files.
The models these files hold are built by load.py; fits.py checks that a CLIP fits a DALLE.
"""

from __future__ import annotations

import os

from ..compat.weights import is_predecessor, predecessor_export
from ..files import atomic_save, resolve, safe_load
from ..models import llamagen

EXPORT_FORMAT_VERSION = 1


WEIGHTS = ("auto", "ema", "raw")  # which weights of an export a reader uses (export_weights)


def save_export(path: str, kind: str, config: dict, weights: dict, ema: dict | None = None, **extra) -> None:
    """safetensors for a .safetensors path (the trainers' default), torch's weights-only pickle otherwise; the
    same content either way: tuples are written as lists, as JSON (and so safetensors' metadata) has them.
    `ema`: {"decay", "weights"} of a run with --ema (its parameters), stored beside the raw weights."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    export = {"format_version": EXPORT_FORMAT_VERSION, "kind": kind, "config": config, "weights": weights, **extra}
    if ema is not None:
        export["ema"] = ema
    atomic_save(_lists(export), path)


def export_weights(obj: dict, which: str = "auto", path: str = "the export") -> dict:
    """The state dict of an export to load: with `which` 'auto', the moving average of the weights where the run
    kept one (--ema), else the raw weights; 'ema' insists on the average, 'raw' takes the last step's weights."""
    if which not in WEIGHTS:
        raise ValueError(f"--weights must be one of {', '.join(WEIGHTS)} (got {which!r})")
    if which == "raw" or which == "auto" and "ema" not in obj:
        return obj["weights"]
    if "ema" not in obj:
        raise ValueError(f"--weights ema: {path} holds no EMA (train with --ema DECAY), use --weights raw or auto")
    return {**obj["weights"], **obj["ema"]["weights"]}  # the average covers the parameters; buffers are raw


def _read(path: str, kind: str):
    """safe_load, and for a file that pickles classes (LlamaGen's checkpoints keep their argparse Namespace) the
    inert reader, which runs none of their code."""
    try:
        return safe_load(path)
    except ValueError as e:
        if "pickled code" not in str(e):
            raise
    from ..models.inert_pickle import load_untrusted

    obj = load_untrusted(path, f"--{kind}_path")
    if not isinstance(obj, dict) or not llamagen.kind_of(llamagen.checkpoint_weights(obj)):
        raise ValueError(
            f"refusing to load {path}: it contains pickled code and is not an export of this project or "
            f"{llamagen.EXPECTED}"
        )
    return obj


def _llamagen_export(obj, found: str, path: str, kind: str, image_size: int) -> dict:
    if found == "vq" and kind == "vae":
        return llamagen.vq_export(llamagen.checkpoint_weights(obj), image_size, path)
    if found == "c2i":
        raise ValueError(
            f"{path} is a class-conditional LlamaGen GPT: only its text-to-image (t2i_*) ones read captions"
        )
    if found == "vq":
        raise ValueError(f"{path} is LlamaGen's VQ tokenizer: pass it with --vae_path")
    if kind == "dalle":
        raise ValueError(
            f"{path} is LlamaGen's text-to-image GPT, which holds neither its image tokenizer nor its text encoder: "
            "convert it once with `python -m dalle_pytorch.convert --from_llamagen "
            f"{path} --vae_path VQ.pt --text_encoder_path google/flan-t5-xl --out dalle.safetensors` (docs/llamagen.md)"
        )
    raise ValueError(f"{path} is LlamaGen's text-to-image GPT, not a {kind}: pass it with --dalle_path")


def _lists(node):
    if isinstance(node, dict):
        return {k: _lists(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_lists(v) for v in node]
    return node


def load_export(path: str, kind: str, predecessor: dict | None = None, say=print, image_size: int = 0) -> dict:
    """The export at `path`, or a checkpoint of lucidrains' dalle-pytorch 1.6 or a LlamaGen VQ converted in memory;
    `predecessor`: the predecessor's flags that say how to read its DALLE (bpe_path, hug, chinese,
    vqgan_config_path); `image_size`: the side a LlamaGen VQ tokenizes (--pretrained_image_size; 0: 256)."""
    obj = _read(resolve(path, f"--{kind}_path"), kind)
    llamagen_kind = llamagen.kind_of(llamagen.checkpoint_weights(obj)) if "format_version" not in obj else ""
    if llamagen_kind:
        return _llamagen_export(obj, llamagen_kind, path, kind, image_size)
    if image_size:
        raise ValueError("--pretrained_image_size is for pretrained tokenizers; our VAE has its own size")
    if is_predecessor(obj) and kind in ("vae", "dalle"):
        say(
            f"{path}: a dalle-pytorch 1.6 {kind} checkpoint, converted on the fly "
            f"(`python -m dalle_pytorch.convert --from_reference {path} --out NEW.pt` converts it once)"
        )
        return {"format_version": EXPORT_FORMAT_VERSION, **predecessor_export(obj, path, kind, **(predecessor or {}))}
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
