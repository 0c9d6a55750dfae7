"""Sampling image tokens: prefill the caption, then one token per step with a static KV cache.

Classifier-free guidance runs the conditional and the unconditional (all-padding caption) rows as one
batch, each with its own cache rows; the caption tensor is never modified. Tokens are drawn with the
Gumbel-max trick from a seeded generator, so no per-token host synchronization is needed.
"""

from __future__ import annotations

import torch

from .filtering import Noise, filter_logits

DECODINGS = ("sequential", "sjd")
SJD_WINDOW = 16  # speculative Jacobi decoding's drafts per pass (bench/sample.py)


def pick_token(logits, noise, temperature: float, top_k: int, top_p: float, cond_scale: float) -> torch.Tensor:
    """One step's choice from the logits of every row (b or 2b, V): guidance, filtering, then Gumbel-max with
    the uniform noise `noise` (b, V) drawn by the caller (greedy when temperature == 0). Returns the rows'
    next tokens: with guidance both halves continue with the guided token."""
    if cond_scale != 1.0:
        cond, uncond = logits.chunk(2)
        logits = uncond + (cond - uncond) * cond_scale
    logits = filter_logits(logits, top_k, top_p)
    if temperature == 0:
        token = logits.argmax(dim=-1)
    else:
        token = (logits / temperature - torch.log(-torch.log(noise.clamp(1e-20, 1.0)))).argmax(dim=-1)
    return torch.cat([token, token]) if cond_scale != 1.0 else token


@torch.no_grad()
def generate_image_tokens(
    model,
    text: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    cond_scale: float = 1.0,
    prime: torch.Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    use_cache: bool = True,
    compile: bool | str = False,
    on_token=None,
    decoding: str = "sequential",
    window: int = SJD_WINDOW,
) -> torch.Tensor:
    """(b, text_seq_len) caption ids, or (b, text_seq_len, F) caption features for a DALLE that reads captions
    through a frozen encoder -> (b, image_seq_len) image token ids. use_cache=False recomputes the
    whole prefix every token (the reference the cache is checked against). compile: each step (decode and
    pick) through torch.compile, one graph for every position, compiled once per model, batch and settings;
    compile="reduce-overhead" replays that graph as a CUDA graph (on a GPU: no per-kernel launch cost).
    generator: one for the batch, or one per row (a list of b): then each row's draws are its own, so a row gives
    the same tokens alone (with its generator) as batched with others (a service batching requests).
    decoding: "sequential", or "sjd": speculative Jacobi decoding with `window` drafts (models/sjd.py), the same
    distribution in fewer passes."""
    if decoding not in DECODINGS:
        raise ValueError(f"--decoding must be one of {', '.join(DECODINGS)} (got {decoding!r})")
    if decoding == "sjd":
        if compile or not use_cache:
            raise ValueError("--decoding sjd runs eager with the KV cache: drop --compile / --no_cache")
        from .sjd import generate_sjd

        def progress(k):
            for _ in range(k):
                on_token()

        return generate_sjd(
            model, text, window=window, temperature=temperature, top_k=top_k, top_p=top_p, cond_scale=cond_scale,
            prime=prime, generator=generator, on_tokens=None if on_token is None else progress,
        )  # fmt: skip
    if compile and not use_cache:
        raise ValueError("compile=True compiles the cached decode step: it needs use_cache=True (drop --no_cache)")
    cfg = model.cfg
    b = text.shape[0]
    guided = cond_scale != 1.0
    rows = torch.cat([text, text]) if guided else text
    null = None  # the unconditional rows read the null caption (all padding for token ids)
    if guided:
        null = torch.arange(2 * b, device=text.device) >= b
    image = prime if prime is not None else torch.zeros(b, 0, dtype=torch.long, device=text.device)
    if guided:
        image = torch.cat([image, image])
    k0 = image.shape[1]
    settings = (temperature, top_k, top_p, cond_scale)
    if use_cache:
        cache = model.new_cache(rows.shape[0], text.device, next(model.parameters()).dtype)
        logits = model.prefill(rows, cache, image if k0 else None, null)
        step = _compiled_step(model, settings, compile) if compile else _step(model, settings)
    else:
        logits = _next_logits_uncached(model, rows, image, null)
    vocab = logits.shape[-1]

    draw = Noise(generator, b, text.device)

    def noise():  # drawn here, in the same order with or without compile, so a seed gives the same images
        return torch.zeros((), device=text.device) if temperature == 0 else draw(vocab)

    new = pick_token(logits, noise(), *settings)
    for k in range(k0, cfg.image_seq_len):
        image = torch.cat([image, new[:, None]], dim=1)
        if on_token is not None:
            on_token()
        if k + 1 == cfg.image_seq_len:
            break
        if use_cache:  # decode token k at input position prefix + k, pick token k + 1
            new = step(new, torch.tensor(cfg.prefix_len + k, device=text.device), cache, noise())
        else:
            new = pick_token(_next_logits_uncached(model, rows, image, null), noise(), *settings)
    return image[:b]


@torch.no_grad()
def generate_text_tokens(
    model,
    prefix: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Continue captions from the model's text half: prefix (b, text_seq_len) ids, padded with 0 after the
    given tokens (all padding: invent one) -> (b, text_seq_len). A row ends at the first padding token it
    samples (0, or any padding id of the reference layout), which becomes 0; the rest of that row stays 0.
    A full forward per token: captions are short next to the image."""
    cfg = model.cfg
    text = prefix.clone()
    given = (~model.is_padding(text)).long().cumprod(dim=1).sum(dim=1)  # leading non-padding tokens per row
    done = torch.zeros(text.shape[0], dtype=torch.bool, device=text.device)
    for p in range(int(given.min()), cfg.text_seq_len):
        logits = model.text_logits(text)[:, p]  # (b, num_text_tokens)
        noise = torch.rand(logits.shape, device=text.device, generator=generator)
        token = pick_token(logits, noise, temperature, top_k, top_p, 1.0)
        fill = (p >= given) & ~done
        done |= fill & model.is_padding(token)
        text[:, p] = torch.where(fill & ~done, token, text[:, p])
    return text


def _next_logits_uncached(model, text: torch.Tensor, image: torch.Tensor, null=None) -> torch.Tensor:
    """Logits for image token k given tokens (b, k) so far, from a full forward over the prefix. logits()
    never feeds its last image token in, so a placeholder there puts every given token in the input."""
    placeholder = image.new_zeros(image.shape[0], 1)
    logits = model.logits(text, torch.cat([image, placeholder], dim=1), null)
    return logits[:, -1, model.cfg.num_text_tokens :].float()


def _step(model, settings: tuple):
    """One decode step and the pick that follows it: the same function eager and compiled."""

    def step(token, pos, cache, noise):
        return pick_token(model.decode_step(token, pos, cache), noise, *settings)

    return step


def _compiled_step(model, settings: tuple, mode: bool | str = True):
    """_step through torch.compile, kept on the model so later batches reuse it. By default inductor's
    freezing folds the weights in as constants and prepacks them for the CPU's matmul library; with a mode
    ("reduce-overhead": CUDA graphs) torch.compile's own settings for that mode apply."""
    compiled = model.__dict__.setdefault("_compiled_steps", {})
    key = (*settings, mode)
    if key not in compiled:
        if isinstance(mode, str):
            compiled[key] = torch.compile(_step(model, settings), fullgraph=True, dynamic=False, mode=mode)
        else:
            compiled[key] = torch.compile(
                _step(model, settings), fullgraph=True, dynamic=False, options={"freezing": True}
            )
    return compiled[key]
