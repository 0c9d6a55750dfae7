"""The blocks' parts that come in two generations: 2021's (LayerNorm, GEGLU as in the reference) and Llama's
(RMSNorm, SwiGLU; Touvron et al. 2023, as LlamaGen runs them for image tokens). `--norm` and `--ff` choose."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

NORMS = ("layernorm", "rmsnorm")
FEED_FORWARDS = ("geglu", "swiglu")


def norm_layer(kind: str, dim: int) -> nn.Module:
    """LayerNorm (mean and variance, with a bias) or RMSNorm (scale only; eps as Llama's and LlamaGen's)."""
    if kind == "rmsnorm":
        return nn.RMSNorm(dim, eps=1e-5)
    if kind == "layernorm":
        return nn.LayerNorm(dim)
    raise ValueError(f"--norm: unknown {kind!r}; use one of {', '.join(NORMS)}")


def swiglu_hidden(dim: int, mult: int, multiple_of: int) -> int:
    """Llama's hidden width: 2/3 of mult * dim (the gate's third matrix keeps the parameters of a mult-wide MLP),
    rounded up to a multiple of `multiple_of` (LlamaGen: 4 * 1024 -> 2730 -> 2816 at multiple_of 256)."""
    hidden = int(2 * mult * dim / 3)
    return multiple_of * -(-hidden // multiple_of)


class FeedForward(nn.Module):
    """GEGLU feed-forward (as in the reference): hidden width mult * dim, with biases."""

    def __init__(self, dim: int, mult: int, dropout: float):
        super().__init__()
        self.proj_in = nn.Linear(dim, dim * mult * 2)
        self.drop = nn.Dropout(dropout)
        self.proj_out = nn.Linear(dim * mult, dim)

    def forward(self, x):
        a, gate = self.proj_in(x).chunk(2, dim=-1)
        return self.proj_out(self.drop(a * F.gelu(gate)))


class SwiGLU(nn.Module):
    """Llama's feed-forward: w2(silu(w1 x) * w3 x), no biases (Shazeer 2020; LlamaGen's FeedForward)."""

    def __init__(self, dim: int, hidden: int, dropout: float):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.drop = nn.Dropout(dropout)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(self.drop(F.silu(self.w1(x)) * self.w3(x)))


def feed_forward(cfg) -> nn.Module:
    """The feed-forward `cfg.ff` names, at the width its generation uses."""
    if cfg.ff == "swiglu":
        return SwiGLU(cfg.dim, swiglu_hidden(cfg.dim, cfg.ff_mult, cfg.ff_multiple_of), cfg.ff_dropout)
    if cfg.ff == "geglu":
        return FeedForward(cfg.dim, cfg.ff_mult, cfg.ff_dropout)
    raise ValueError(f"--ff: unknown {cfg.ff!r}; use one of {', '.join(FEED_FORWARDS)}")
