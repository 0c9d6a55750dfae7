"""A DALLE export made from LlamaGen's published text-to-image GPT (models/llamagen.py) and the two files it needs
beside it: its VQ tokenizer (--vae_path vq_ds16_t2i.pt) and its text encoder (FLAN-T5-XL, --text_encoder_path).

    python -m dalle_pytorch.convert --from_llamagen t2i_XL_stage1_256.pt --vae_path vq_ds16_t2i.pt \\
        --text_encoder_path google/flan-t5-xl --out llamagen-t2i-xl.safetensors

The export is ours in every way (generate.py, serve.py, the evaluation, `train_dalle.py --dalle_path` to fine-tune
it, the Hub): the VQ's weights inside it, the encoder recorded with its fingerprint. train_dalle.py builds the same
export in memory when --dalle_path names the GPT file itself, and so do generate.py, serve.py and the evaluation:
without --vae_path the VQ is LlamaGen's vq_ds16_t2i.pt beside the GPT (in its folder, or its Hub repository), and
without --text_encoder_path the encoder is google/flan-t5-xl, as LlamaGen's sample_t2i.py has them."""

from __future__ import annotations

import os

from ..files import is_safetensors, resolve
from ..models import llamagen
from .export import EXPORT_FORMAT_VERSION, _read, load_export


def llamagen_kind(path: str) -> str:
    """ "t2i", "c2i", "vq" for LlamaGen's checkpoints, "" for anything else (our exports included). Reads the file's
    names only: a zip file's tensors stay on disk until used (mmap)."""
    path = resolve(path) if path else path
    if not path or not os.path.isfile(path) or is_safetensors(path):  # ours, or LlamaGen's never
        return ""
    try:
        obj = _read(path, "dalle")
    except ValueError:
        return ""
    return (
        "" if isinstance(obj, dict) and "format_version" in obj else llamagen.kind_of(llamagen.checkpoint_weights(obj))
    )


T2I_VQ = "vq_ds16_t2i.pt"  # LlamaGen's VQ for its T2I GPTs
T2I_ENCODER = "google/flan-t5-xl"


def companion_vq(gpt_path: str) -> str:
    """LlamaGen's T2I VQ beside its GPT: in the GPT file's folder, or its Hub repository; "" if neither."""
    if os.path.isfile(gpt_path):
        beside = os.path.join(os.path.dirname(os.path.abspath(gpt_path)), T2I_VQ)
        return beside if os.path.isfile(beside) else ""
    parts = gpt_path.split("/")
    return "/".join([*parts[:2], T2I_VQ]) if len(parts) >= 3 else ""


def llamagen_dalle_export(
    gpt_path: str, vae_path: str, text_encoder_path: str, image_size: int = 0, device="cpu", say=print
) -> dict:
    """The DALLE export of LlamaGen's T2I GPT at gpt_path, read with the VQ at vae_path (any image tokenizer export
    of its vocabulary) and the T5 encoder at text_encoder_path (a folder or a Hub name)."""
    from ..data.encoder_tokenizer import EncoderTokenizer
    from .text_encoders import FrozenTextEncoder

    kind = llamagen_kind(gpt_path)
    if kind != "t2i":
        what = {"c2i": "a class-conditional LlamaGen GPT", "vq": "LlamaGen's VQ tokenizer"}.get(kind, "not LlamaGen's")
        raise ValueError(f"{gpt_path} is {what}: pass LlamaGen's text-to-image GPT (t2i_XL_stage1_256.pt)")
    vae_path = vae_path or companion_vq(gpt_path)
    if not vae_path:
        raise ValueError(
            f"{gpt_path} is LlamaGen's GPT and no {T2I_VQ} lies beside it: give its VQ tokenizer with --vae_path, or "
            "convert the pair once (python -m dalle_pytorch.convert --from_llamagen GPT --vae_path VQ ...)"
        )
    text_encoder_path = text_encoder_path or T2I_ENCODER
    weights = llamagen.checkpoint_weights(_read(resolve(gpt_path), "dalle"))
    vae_export = load_export(vae_path, "vae", image_size=image_size)
    vq = vae_export["config"]  # our VQTokenizer's (or a dVAE's): the image side, the downsamplings, the codes
    fmap = vq["image_size"] >> vq["num_layers"]
    cfg = llamagen.gpt_config(weights, fmap, gpt_path)
    if cfg.num_image_tokens != vq["num_tokens"]:
        raise ValueError(
            f"{gpt_path} predicts {cfg.num_image_tokens} image codes, --vae_path {vae_path} has {vq['num_tokens']}: "
            "pass the VQ it was trained with (vq_ds16_t2i.pt)"
        )
    tokenizer = EncoderTokenizer("t5", text_encoder_path)
    encoder = FrozenTextEncoder(tokenizer, device)
    if encoder.dim != cfg.text_feature_dim:
        raise ValueError(
            f"--text_encoder_path {text_encoder_path} gives {encoder.dim} features, {gpt_path} reads "
            f"{cfg.text_feature_dim} (FLAN-T5-XL's): pass the encoder it was trained with"
        )
    say(
        f"{gpt_path}: LlamaGen's T2I GPT ({cfg.dim} wide, {cfg.depth} layers, {cfg.heads} heads), "
        f"{fmap}x{fmap} codes of {vae_path}, captions through {text_encoder_path}"
    )
    return {
        "format_version": EXPORT_FORMAT_VERSION,
        "kind": "dalle",
        "config": cfg.to_dict(),
        "weights": llamagen.gpt_weights(weights, cfg, gpt_path),
        "vae": vae_export,
        "tokenizer": encoder.record(),
    }
