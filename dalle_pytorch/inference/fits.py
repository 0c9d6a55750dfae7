"""What a CLIP must share with a DALLE to rank its images, and the check that refuses one that does not."""

from __future__ import annotations

from .export import load_export


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


def loaded_fit(dalle, vae, tokenizer) -> dict:
    """dalle_fit of a DALLE already loaded (load.load_dalle), without reading its file again."""
    return {
        "tokenizer": tokenizer.to_dict(),
        "text_seq_len": dalle.cfg.text_seq_len,
        "image_size": vae.image_size,
        "channels": vae.channels,
    }


def check_clip_fits(clip, clip_tokenizer, fit: dict, dalle_path: str, clip_path: str) -> None:
    """A CLIP ranks a DALLE's images only if it reads the same captions and images (`fit`: dalle_fit or
    loaded_fit of the DALLE at `dalle_path`): refuse it otherwise. A published CLIP (open_clip) reads any caption
    and resizes any RGB image."""
    if getattr(clip, "pretrained", False):
        if fit["channels"] != 3:
            raise ValueError(f"--clip_path {clip_path} reads RGB images, {dalle_path} makes {fit['channels']} channels")
        return
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
