"""What train_dalle.py and convert build from the image-tokenizer flags: the frozen tokenizer with its
export (our VAE's) or record (a pretrained one's) and one fingerprint, the check that a resumed run keeps
its tokenizer, and the image tokens precomputed once for --precompute_tokens."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping

import torch

from ..data.tokenized import PrecomputedTokens, precompute_tokens
from ..files import atomic_save, fingerprint, safe_load
from ..models.pretrained import load_openai, load_vqgan
from .export import load_vae


def load_image_tokenizer(flags: Mapping):
    """(tokenizer, export or record, fingerprint) from the flags that choose it, as train_dalle.py parses them or
    config.json's `dalle` section records them."""
    vae_path, taming, openai_vae_path = flags["vae_path"], flags["taming"], flags["openai_vae_path"]
    vqgan_model_path, vqgan_config_path = flags["vqgan_model_path"], flags["vqgan_config_path"]
    image_size = flags["pretrained_image_size"]
    if (vqgan_model_path or vqgan_config_path) and not taming:
        raise ValueError("--vqgan_model_path and --vqgan_config_path are read with --taming: add --taming")
    chosen = [
        f for f, on in (("--vae_path", vae_path), ("--taming", taming), ("--openai_vae_path", openai_vae_path)) if on
    ]
    if len(chosen) > 1:
        raise ValueError(f"{' and '.join(chosen)} each choose the image tokenizer: pass only one of them")
    if not chosen:
        raise ValueError(
            "--vae_path is required: train a VAE first with `python train_vae.py` and pass its vae.pt, or use a "
            "pretrained tokenizer with --taming --vqgan_model_path M --vqgan_config_path C, or --openai_vae_path DIR"
        )
    if image_size and vae_path:
        raise ValueError("--pretrained_image_size is for --taming and --openai_vae_path; our VAE has its own size")
    if image_size < 0:
        raise ValueError(f"--pretrained_image_size must be positive, or 0 for the tokenizer's own (got {image_size})")
    if taming:
        if not (vqgan_model_path and vqgan_config_path):
            raise ValueError(
                "--taming needs --vqgan_model_path (.ckpt) and --vqgan_config_path (.yaml): nothing is downloaded"
            )
        vae, record = load_vqgan(vqgan_model_path, vqgan_config_path, image_size)
    elif openai_vae_path:
        vae, record = load_openai(openai_vae_path, image_size)
    else:
        vae, export = load_vae(vae_path)
        return vae, export, fingerprint(export["config"], export["weights"])
    return vae, record, record["fingerprint"]


def tokenizer_flag(flags: Mapping) -> str:
    """The flags that chose the image tokenizer, for messages."""
    if flags["taming"]:
        return f"--taming --vqgan_model_path {flags['vqgan_model_path']}"
    if flags["openai_vae_path"]:
        return f"--openai_vae_path {flags['openai_vae_path']}"
    return f"--vae_path {flags['vae_path']}"


def check_same_tokenizer(run_dir: str, vae_id: str, vae_flag: str) -> None:
    """A resumed run must keep its image tokenizer: another one changes the meaning of every image token."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        return
    with open(path) as f:
        recorded = json.load(f).get("vae_fingerprint")
    if recorded and recorded != vae_id:
        raise ValueError(
            f"{vae_flag} is not the VAE this run was trained with (fingerprint {vae_id}, the run "
            f"recorded {recorded}): pass the original VAE, or start a new run with another --name"
        )


def precomputed(dataset, vae, vae_id: str, run, backend) -> PrecomputedTokens:
    """Image tokens of the whole dataset, computed once on rank 0 and cached in the run directory."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise ValueError(
            "--precompute_tokens needs a caption folder or the built-in dataset, not streamed --wds shards"
        )
    path = os.path.join(run.path, "tokens.pt")
    if backend.is_main:
        cached = safe_load(path) if os.path.exists(path) else None
        if cached is None or cached["vae_fingerprint"] != vae_id or len(cached["text"]) != len(dataset):
            t = time.perf_counter()
            data = precompute_tokens(dataset, vae.to(backend.device))
            atomic_save({"vae_fingerprint": vae_id, "image_tokens": data.image_tokens, "text": data.text}, path)
            run.print(f"precomputed image tokens of {len(data)} samples in {time.perf_counter() - t:.1f}s: {path}")
    backend.barrier()
    cached = safe_load(path)
    return PrecomputedTokens(cached["image_tokens"], cached["text"], dataset.truncated.value)
