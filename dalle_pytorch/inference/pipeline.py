"""Generate -> decode -> rerank -> keep: the one pipeline generate.py and the evaluation share.

`SamplingConfig` and `RerankConfig` are their shared flag groups (written once: dalle_pytorch.config builds both
parsers from them). `candidate_images` samples image tokens for caption rows and decodes them; `load_reranker`
reads a CLIP that fits the DALLE; `best_of` ranks one caption's candidates with it (DALL-E's reranking) and
says which to keep, best first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..compat.flags import top_k_arg, top_k_count
from ..config import flag
from ..models.clip import rank_by_clip
from ..models.sampling import DECODINGS, SJD_WINDOW, generate_image_tokens
from .export import WEIGHTS
from .fits import check_clip_fits, loaded_fit
from .load import load_clip


@dataclass
class SamplingConfig:
    """How image tokens are drawn."""

    temperature: float = flag(1.0, "sampling temperature (0: greedy)")
    top_k: float = flag(
        0,
        "sample among the k most likely tokens (0: all); a fraction is the predecessor's threshold (0.9)",
        type=top_k_arg,
    )
    top_p: float = flag(1.0, "nucleus sampling mass (1: off)")
    cond_scale: float = flag(1.0, "classifier-free guidance scale (1: off)")
    weights: str = flag(
        "auto",
        "the DALLE's weights that sample: auto (the moving average where the run kept one with --ema, else the "
        "raw weights), ema, or raw (the last step's)",
        choices=WEIGHTS,
    )
    text_encoder_path: str = flag(
        "",
        "where the DALLE's frozen text encoder (--text_encoder) lives on this machine, a folder or a Hugging Face "
        "name (default: where it was trained; another encoder than that one is refused)",
    )
    decoding: str = flag(
        "sequential",
        "sequential (one token per pass) or sjd: speculative Jacobi decoding, several tokens per pass from the same "
        "distribution (models/sjd.py)",
        choices=DECODINGS,
    )
    sjd_window: int = flag(SJD_WINDOW, "--decoding sjd: draft tokens per pass")

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"--temperature must be at least 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top_p must be in (0, 1] (got {self.top_p})")
        if self.sjd_window < 1:
            raise ValueError(f"--sjd_window must be at least 1 (got {self.sjd_window})")

    def token_options(self, dalle, vocabulary: int | None = None, say=print) -> dict:
        """generate_image_tokens' keywords for `dalle`: --top_k as a count of the `vocabulary` being sampled
        (default: the image tokens; the predecessor's threshold counted text and image logits together)."""
        cfg = dalle.cfg
        vocabulary = cfg.num_image_tokens if vocabulary is None else vocabulary
        top_k = top_k_count(self.top_k, cfg.num_text_tokens + cfg.num_image_tokens, vocabulary, say)
        if self.cond_scale != 1 and not getattr(cfg, "null_cond_prob", 0):
            say(
                f"warning: --cond_scale {self.cond_scale:g} on a DALLE trained without --null_cond_prob: it never "
                "learned to sample without its caption, so guidance pushes from an unconditioned mode it does not "
                "have; train with --null_cond_prob 0.1 (or sample with --cond_scale 1)"
            )
        options = {"temperature": self.temperature, "top_k": top_k, "top_p": self.top_p, "cond_scale": self.cond_scale}
        return {**options, "decoding": self.decoding, "window": self.sjd_window}


@dataclass
class RerankConfig:
    """Which images CLIP keeps."""

    clip_path: str = flag(
        "", "a CLIP that ranks the images: an export of train_clip.py, or open_clip's (ViT-B-32:openai, hf-hub:NAME)"
    )
    keep: int = flag(0, "with --clip_path: the best N images kept per caption (0: all, ranked)")


@torch.no_grad()
def candidate_images(
    dalle, vae, text: torch.Tensor, batch_size: int, generator, on_token=None, **options
) -> torch.Tensor:
    """Images (b, c, s, s) in [0, 1] for the caption rows `text` (b, text_seq_len), `batch_size` rows at a time;
    `options`: generate_image_tokens' keywords (SamplingConfig.token_options, prime, use_cache, compile)."""
    images = []
    prime = options.pop("prime", None)  # (1, n) or None: the same image rows for every caption
    for start in range(0, len(text), batch_size):
        rows = text[start : start + batch_size]
        b = len(rows)
        tokens = generate_image_tokens(
            dalle,
            rows,
            generator=generator,
            prime=None if prime is None else prime.expand(b, -1),
            on_token=None if on_token is None else (lambda b=b: on_token(b)),
            **options,
        )
        images.append(vae.decode(tokens))
    return torch.cat(images)


def load_reranker(clip_path: str, dalle_path: str, dalle, vae, tokenizer, device="cpu"):
    """(CLIP, its tokenizer) from `clip_path`, refused unless it reads the loaded DALLE's captions and images."""
    clip, clip_tokenizer = load_clip(clip_path, device)
    check_clip_fits(clip, clip_tokenizer, loaded_fit(dalle, vae, tokenizer), dalle_path, clip_path)
    return clip, clip_tokenizer


@torch.no_grad()
def best_of(clip, clip_tokenizer, caption: str, images: torch.Tensor, keep: int, batch_size: int = 64):
    """(order, scores): the indices of the `keep` images (0: all) CLIP scores highest with `caption`, best first,
    and their scores."""
    scores = rank_by_clip(clip, clip_tokenizer, caption, images, batch_size)
    order = scores.argsort(descending=True)[: keep or len(images)]
    return order, scores[order]
