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


def sample_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """(b, V) -> (b,) by Gumbel-max (argmax of logits/T + Gumbel noise); greedy when temperature == 0."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    u = torch.rand(logits.shape, device=logits.device, generator=generator).clamp_(1e-20, 1.0)
    return (logits / temperature - torch.log(-torch.log(u))).argmax(dim=-1)


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
    """(b, text_seq_len) caption ids -> (b, image_seq_len) image token ids. compile: decode with
    torch.compile'd `decode_step` (one graph for all positions; compiled once per model and batch size)."""
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
    step = _compiled_decode(model) if compile and use_cache else None
    for k in range(k0, cfg.image_seq_len):
        if guided:
            cond, uncond = logits.chunk(2)
            logits = uncond + (cond - uncond) * cond_scale
        token = sample_token(filter_logits(logits, top_k, top_p), temperature, generator)  # (b,)
        new = torch.cat([token, token]) if guided else token  # both halves continue with the guided token
        image = torch.cat([image, new[:, None]], dim=1)
        if on_token is not None:
            on_token()
        if k + 1 < cfg.image_seq_len:
            if step is not None:
                logits = step(new, torch.tensor(cfg.text_seq_len + k + 1, device=text.device), cache)
            elif use_cache:
                logits = model.decode_one_token(rows, image, cache)
            else:
                logits = model.next_image_logits_uncached(rows, image)
    return image[:b]


def _compiled_decode(model):
    """model.decode_step through torch.compile, kept on the model so that later batches reuse it. Inductor's
    freezing folds the weights in as constants and prepacks them for the CPU's matmul library."""
    if getattr(model, "_compiled_decode_step", None) is None:
        model._compiled_decode_step = torch.compile(
            model.decode_step, fullgraph=True, dynamic=False, options={"freezing": True}
        )
    return model._compiled_decode_step
