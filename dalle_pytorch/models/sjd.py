"""Speculative Jacobi decoding (Teng et al. 2024, arXiv:2410.01699): several image tokens per forward pass, drawn
from exactly the distribution sequential sampling draws from.

Each row keeps a window of draft tokens after its accepted ones, each drawn from a proposal distribution q. One
pass of the model over [the last accepted token, the drafts] (models/dalle.py window_step: every row at its own
positions, the KV cache written in place) gives the target distribution p at every draft's position, conditioned
on the drafts before it. The drafts are then verified in order by the speculative-sampling rule (Leviathan et al.
2023, Chen et al. 2023): draft d is accepted with probability min(1, p(d) / q(d)); at the first rejection a token
is drawn from the normalized residual max(0, p - q) and the row stops there; a row that accepts its whole window
draws one more token from the last position's p. Whatever q was, every token kept is distributed as p given the
tokens before it, so the images are those of sequential sampling in distribution (tests/models/test_sjd.py tests it
as a distribution). The Jacobi part: the next window's drafts are drawn from this pass's p at the positions past
the accepted ones (conditioned on drafts that may have been rejected: a proposal need not be right, only drawn
from q), the positions past the window from the last p.

p is the distribution the sequential sampler draws from: guidance on the logits, top-k and top-p, then the
temperature (at temperature 0 the argmax, so top-k 1 or greedy decoding gives the sequential tokens exactly).
Rejected drafts' keys and values stay in the cache past the accepted position, where the causal mask hides them
until the next pass overwrites them. Every row draws the same amount of noise per pass from its generator, so
with one generator per row a row's tokens do not depend on the rows batched with it.
"""

from __future__ import annotations

import torch

from .filtering import Noise, filter_logits


def target_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, cond_scale: float):
    """(rows, ..., V) logits, both guidance halves when cond_scale != 1 -> (b, ..., V) probabilities of the token
    the sequential sampler (sampling.pick_token) would draw."""
    if cond_scale != 1.0:
        cond, uncond = logits.chunk(2)
        logits = uncond + (cond - uncond) * cond_scale
    logits = filter_logits(logits.float(), top_k, top_p)
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return (logits / temperature).softmax(-1)


def categorical(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One draw per row of probs (..., V) by the Gumbel-max trick with uniform `noise` of the same shape."""
    return (probs.log() - torch.log(-torch.log(noise.clamp(1e-20, 1.0)))).argmax(-1)


def correction(p: torch.Tensor, q: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """The distribution of the token after a row's accepted drafts (b, V): the residual max(0, p - q), normalized,
    where a draft was `rejected` (b,); p itself after a whole accepted window."""
    residual = torch.where(rejected[:, None], (p - q).clamp_min(0), p)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)  # p == q: a draft is never rejected
    return residual / residual.sum(-1, keepdim=True)


@torch.no_grad()
def generate_sjd(
    model,
    text: torch.Tensor,
    *,
    window: int = 16,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    cond_scale: float = 1.0,
    prime: torch.Tensor | None = None,
    generator=None,
    stats: dict | None = None,
    on_tokens=None,
) -> torch.Tensor:
    """generate_image_tokens' result (b, image_seq_len) by speculative Jacobi decoding with `window` drafts per
    row. `stats` (a dict) receives `passes` (forward passes, the prefill included) and `accepted` (tokens each pass
    kept, per row). `on_tokens(k)`: the batch's slowest row has k more tokens."""
    if window < 1:
        raise ValueError(f"--sjd_window must be at least 1 (got {window})")
    cfg, device = model.cfg, text.device
    b, n_img, size = text.shape[0], cfg.image_seq_len, window
    guided = cond_scale != 1.0
    rows = torch.cat([text, text]) if guided else text
    null = torch.arange(2 * b, device=device) >= b if guided else None
    k0 = 0 if prime is None else prime.shape[1]
    noise = Noise(generator, b, device)
    settings = (temperature, top_k, top_p, cond_scale)

    def both(x):  # the guidance halves read the same tokens
        return torch.cat([x, x]) if guided else x

    cache = model.new_cache(rows.shape[0], device, next(model.parameters()).dtype, extra=size + 1)
    logits = model.prefill(rows, cache, both(prime) if k0 else None, null)
    p0 = target_probs(logits, *settings)  # (b, V): image token k0
    vocab = p0.shape[-1]
    tokens = torch.zeros(b, n_img + size + 1, dtype=torch.long, device=device)  # past n_img: a window's overhang
    if k0:
        tokens[:, :k0] = prime
    tokens[:, k0] = categorical(p0, noise(vocab))
    done = torch.full((b,), k0 + 1, device=device)  # tokens kept per row
    q = p0[:, None].expand(b, size, vocab).contiguous()  # proposals of the drafts for tokens done .. done + size - 1
    drafts = categorical(q, noise(size, vocab))
    passes, accepted = 1, []
    steps = torch.arange(size + 1, device=device)
    while bool((done < n_img).any()):
        last = tokens.gather(1, (done - 1)[:, None])
        logits = model.window_step(both(torch.cat([last, drafts], 1)), both(done - 1), cache)
        p = target_probs(logits, *settings)  # (b, size + 1, V): p[:, j] is token done + j's
        passes += 1
        pd = p[:, :size].gather(-1, drafts[..., None])[..., 0]
        qd = q.gather(-1, drafts[..., None])[..., 0]
        ok = noise(size) * qd < pd  # accepted with probability min(1, p/q)
        n_ok = ok.long().cumprod(1).sum(1)  # (b,): the drafts accepted before the first rejection
        p_at = p.gather(1, n_ok[:, None, None].expand(-1, 1, vocab))[:, 0]
        q_at = q.gather(1, n_ok.clamp(max=size - 1)[:, None, None].expand(-1, 1, vocab))[:, 0]
        extra = categorical(correction(p_at, q_at, n_ok < size), noise(vocab))
        new = torch.cat([drafts, drafts[:, :1]], 1).scatter(1, n_ok[:, None], extra[:, None])  # kept, then extra
        gained = torch.minimum(n_ok + 1, n_img - done)  # never past the image; 0 for finished rows
        at = done[:, None] + steps  # distinct columns: the overhang lands past the image
        keep = steps[None] < gained[:, None]
        tokens.scatter_(1, at, torch.where(keep, new, tokens.gather(1, at)))
        accepted.append(gained)
        slowest = int(done.min())
        done = done + gained
        if on_tokens is not None:
            on_tokens(int(done.min()) - slowest)
        # the next drafts: this pass's p past the kept tokens (Jacobi), the last p past the window
        source = (gained[:, None] + steps[:size]).clamp(max=size)
        q = p.gather(1, source[..., None].expand(-1, -1, vocab))
        drafts = categorical(q, noise(size, vocab))
    if stats is not None:
        stats["passes"] = passes
        stats["accepted"] = torch.stack(accepted, 1) if accepted else torch.zeros(b, 0)
    return tokens[:, :n_img]
