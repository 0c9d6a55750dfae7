"""The image tokenizer in training (the tokenizer itself: inference/image_tokenizers.py): the --dalle_path a run
starts from (its export and tokenizer, also for convert), the check that a resumed run keeps its tokenizer, and
the image tokens precomputed once for --precompute_tokens."""

from __future__ import annotations

import os
import time

from ..data.stream import is_stream
from ..data.tokenized import PrecomputedTokens, precompute_tokens
from ..files import atomic_save, safe_load
from ..inference.load import read_dalle


def check_same_tokenizer(record: dict, vae_id: str, vae_flag: str) -> None:
    """A resumed run must keep its image tokenizer: another one changes the meaning of every image token.
    `record`: the run's config.json (RunDir.recorded)."""
    recorded = record.get("vae_fingerprint")
    if recorded and recorded != vae_id:
        raise ValueError(
            f"{vae_flag} is not the VAE this run was trained with (fingerprint {vae_id}, the run "
            f"recorded {recorded}): pass the original VAE, or start a new run with another --name"
        )


def precomputed(dataset, vae, vae_id: str, run, backend) -> PrecomputedTokens:
    """Image tokens of the whole dataset, computed once on rank 0 and cached in the run directory."""
    if is_stream(dataset):
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


def start_of(run_cfg, say=print) -> tuple[dict, object]:
    """(export, image tokenizer) of the --dalle_path a DALLE run started from, read as train_dalle.py read it
    (`run_cfg`: its DALLERunConfig, as parsed or as its config.json records it). LlamaGen's T2I GPT is read with
    the VQ of --vae_path and the encoder of --text_encoder_path (inference/published.py)."""
    from ..inference.load import vae_from_export
    from ..inference.published import llamagen_dalle_export, llamagen_kind

    if llamagen_kind(run_cfg.dalle_path):
        export = llamagen_dalle_export(
            run_cfg.dalle_path, run_cfg.vae_path, run_cfg.text_encoder_path, run_cfg.pretrained_image_size, say=say
        )
        return export, vae_from_export(export["vae"])
    # the predecessor's dalle.pt does not say which text tokenizer it used: its flags do (our exports carry theirs)
    predecessor = {
        "bpe_path": run_cfg.bpe_path,
        "hug": run_cfg.hug,
        "chinese": run_cfg.tokenizer == "chinese",
        "vqgan_config_path": run_cfg.vqgan_config_path,
    }
    return read_dalle(run_cfg.dalle_path, run_cfg.vqgan_model_path, run_cfg.openai_vae_path, predecessor, say)
