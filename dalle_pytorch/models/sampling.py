"""Sampling image tokens: prefill the caption, then one token per step with a static KV cache.

Classifier-free guidance runs the conditional and the unconditional (all-padding caption) rows as one
batch, each with its own cache rows; the caption tensor is never modified. Tokens are drawn with the
Gumbel-max trick from a seeded generator, so no per-token host synchronization is needed.
"""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Logits with -inf outside the top-k set and outside the smallest set whose probability reaches top_p."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
        drop_sorted = before >= top_p  # keeps the first token always
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


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
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    compile: bool = False,
    on_token=None,
) -> torch.Tensor:
    """(b, text_seq_len) caption ids -> (b, image_seq_len) image token ids. compile: each step (decode and
    pick) through torch.compile, one graph for every position, compiled once per model, batch and settings."""
    cfg = model.cfg
    b = text.shape[0]
    guided = cond_scale != 1.0
    rows = torch.cat([text, torch.zeros_like(text)]) if guided else text  # unconditional = all-padding caption
    image = prime if prime is not None else text.new_zeros(b, 0)
    if guided:
        image = torch.cat([image, image])
    k0 = image.shape[1]
    cache = model.new_cache(rows.shape[0], text.device, next(model.parameters()).dtype) if use_cache else None
    logits = (
        model.prefill(rows, cache, image if k0 else None)
        if use_cache
        else model.next_image_logits_uncached(rows, image)
    )
    settings = (temperature, top_k, top_p, cond_scale)
    step = _compiled_step(model, settings) if compile and use_cache else None
    vocab = logits.shape[-1]

    def noise():  # drawn here, in the same order with or without compile, so a seed gives the same images
        if temperature == 0:
            return torch.zeros((), device=text.device)
        return torch.rand((b, vocab), device=text.device, generator=generator)

    new = pick_token(logits, noise(), *settings)
    for k in range(k0, cfg.image_seq_len):
        image = torch.cat([image, new[:, None]], dim=1)
        if on_token is not None:
            on_token()
        if k + 1 == cfg.image_seq_len:
            break
        if step is not None:  # decode token k, pick token k + 1, in one compiled graph
            new = step(new, torch.tensor(cfg.text_seq_len + k + 1, device=text.device), cache, noise())
            continue
        if use_cache:
            logits = model.decode_one_token(rows, image, cache)
        else:
            logits = model.next_image_logits_uncached(rows, image)
        new = pick_token(logits, noise(), *settings)
    return image[:b]


def _compiled_step(model, settings: tuple):
    """decode_step then pick_token through torch.compile, kept on the model so later batches reuse it.
    Inductor's freezing folds the weights in as constants and prepacks them for the CPU's matmul library."""
    compiled = model.__dict__.setdefault("_compiled_steps", {})
    if settings not in compiled:

        def step(token, pos, cache, noise):
            return pick_token(model.decode_step(token, pos, cache), noise, *settings)

        compiled[settings] = torch.compile(step, fullgraph=True, dynamic=False, options={"freezing": True})
    return compiled[settings]
