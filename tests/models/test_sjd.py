"""Speculative Jacobi decoding draws what sequential sampling draws: as a distribution (per-position tokens and
adjacent pairs of thousands of 4x4 images, a chi-square test that a wrong acceptance rule fails), token for token
at top-k 1 over every transformer option, and row for row whatever the batch around it."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2

from dalle_pytorch.models import sjd
from dalle_pytorch.models.dalle import DALLE, DALLEConfig
from dalle_pytorch.models.sampling import generate_image_tokens

BASE = dict(dim=32, depth=2, heads=2, dim_head=16, text_seq_len=6, num_text_tokens=20, num_image_tokens=8,
            image_fmap_size=4)  # fmt: skip


def peaked(cfg: DALLEConfig, seed: int = 0, sharpness: float = 40.0) -> DALLE:
    """A random DALLE whose next-token distributions are far from uniform and depend on the tokens before: a
    sampler that draws from the wrong distribution shows in a few thousand images."""
    torch.manual_seed(seed)
    model = DALLE(cfg).eval()
    with torch.no_grad():
        model.image_head.weight.mul_(sharpness)
        model.image_emb.weight.mul_(10)
    return model


def captions(cfg: DALLEConfig, n: int) -> torch.Tensor:
    """n rows of two captions: token ids, or a frozen encoder's features with padding after 3 and 5 tokens."""
    g = torch.Generator().manual_seed(5)
    if cfg.text_feature_dim:
        text = torch.randn((2, cfg.text_seq_len, cfg.text_feature_dim), generator=g)
        text[0, 3:], text[1, 5:] = 0, 0
        return text.repeat(n // 2, 1, 1)
    text = torch.randint(1, cfg.num_text_tokens, (2, cfg.text_seq_len), generator=g)
    return text.repeat(n // 2, 1)


def chi_square_p(a: torch.Tensor, b: torch.Tensor, cells: int) -> float:
    """p-value of the two-sample chi-square test that a and b (n, k) draw the same categorical variables, summed
    over the k columns (cells per column), over columns with counts."""
    stat, dof = 0.0, 0
    for j in range(a.shape[1]):
        ca = torch.bincount(a[:, j], minlength=cells).double()
        cb = torch.bincount(b[:, j], minlength=cells).double()
        used = (ca + cb) > 0
        ca, cb = ca[used], cb[used]
        total = ca + cb
        ea, eb = total * ca.sum() / total.sum(), total * cb.sum() / total.sum()
        stat += float(((ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb).sum())
        dof += int(used.sum()) - 1
    return float(chi2.sf(stat, max(dof, 1)))


def same_distribution(first: torch.Tensor, second: torch.Tensor, vocab: int) -> tuple[float, float]:
    """(p of the per-position test, p of the adjacent-pairs test) of two samples of images (n, positions)."""
    pairs = lambda x: x[:, :-1] * vocab + x[:, 1:]  # noqa: E731
    return chi_square_p(first, second, vocab), chi_square_p(pairs(first), pairs(second), vocab * vocab)


SETTINGS = {
    "plain": dict(temperature=1.0),
    "guided-top_p": dict(temperature=0.9, top_p=0.95, cond_scale=3.0),
}


@pytest.mark.parametrize("name", SETTINGS)
def test_sjd_draws_what_sequential_sampling_draws(name):
    cfg = DALLEConfig(**BASE, null_cond_prob=0.1)
    model, n = peaked(cfg), 4000
    text = captions(cfg, n)
    seq = generate_image_tokens(model, text, generator=torch.Generator().manual_seed(1), **SETTINGS[name])
    stats = {}
    fast = sjd.generate_sjd(model, text, window=4, generator=torch.Generator().manual_seed(2), stats=stats,
                            **SETTINGS[name])  # fmt: skip
    per_position, pairs = same_distribution(seq, fast, cfg.num_image_tokens)
    assert per_position > 1e-3 and pairs > 1e-3, (per_position, pairs)
    kept = stats["accepted"][stats["accepted"] > 0].float().mean().item()
    assert kept > 1.1, kept  # more than one token per pass and row (the batch's passes: its slowest row's)
    again = generate_image_tokens(model, text, generator=torch.Generator().manual_seed(3), **SETTINGS[name])
    assert min(same_distribution(seq, again, cfg.num_image_tokens)) > 1e-3  # the test's own calibration


def test_a_wrong_acceptance_rule_fails_the_test(monkeypatch):
    """Resampling a rejected draft from p instead of the residual max(0, p - q): a common mistake that draws
    too often the tokens the drafts proposed. The same test must catch it."""
    cfg = DALLEConfig(**BASE)
    model, n = peaked(cfg), 4000
    text = captions(cfg, n)
    seq = generate_image_tokens(model, text, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(sjd, "correction", lambda p, q, rejected: p)
    broken = sjd.generate_sjd(model, text, window=4, generator=torch.Generator().manual_seed(2))
    assert min(same_distribution(seq, broken, cfg.num_image_tokens)) < 1e-6


OPTIONS = {
    "full": {},
    "sparse": dict(attn_types=["full", "axial_row", "conv_like"]),
    "rotary-gqa-llama": dict(rotary_emb=True, kv_heads=1, norm="rmsnorm", ff="swiglu", ff_multiple_of=16),
    "shared": dict(shared_attn_ids=[0, 0], shared_ff_ids=[0, 0]),
    "stable": dict(stable=True, sandwich_norm=True, qk_norm=True),
    "features": dict(text_feature_dim=8, num_text_tokens=0),
    "llamagen": dict(
        text_feature_dim=8,
        num_text_tokens=0,
        llamagen_layout=True,
        rotary_emb=True,
        norm="rmsnorm",
        ff="swiglu",
        ff_multiple_of=16,
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", OPTIONS)
@pytest.mark.parametrize("cond_scale", [1.0, 3.0])
def test_top_k_1_gives_the_greedy_sequential_tokens(name, cond_scale):
    cfg = DALLEConfig(**{**BASE, "image_fmap_size": 8, **OPTIONS[name]}, null_cond_prob=0.1)
    model = peaked(cfg, sharpness=5.0)
    text = captions(cfg, 4)
    seq = generate_image_tokens(model, text, top_k=1, cond_scale=cond_scale)
    for window in (1, 3, 16):
        assert torch.equal(sjd.generate_sjd(model, text, window=window, top_k=1, cond_scale=cond_scale), seq)
    prime = seq[:, :5]
    primed = generate_image_tokens(model, text, temperature=0, prime=prime, cond_scale=cond_scale)
    assert torch.equal(sjd.generate_sjd(model, text, temperature=0, prime=prime, cond_scale=cond_scale), primed)


def test_a_row_gives_the_same_tokens_alone_as_batched():
    cfg = DALLEConfig(**BASE, null_cond_prob=0.1)
    model = peaked(cfg)
    text = captions(cfg, 4)[:3]
    gens = lambda: [torch.Generator().manual_seed(100 + i) for i in range(3)]  # noqa: E731
    batched = sjd.generate_sjd(model, text, window=5, cond_scale=2.0, generator=gens())
    for i, g in enumerate(gens()):
        alone = sjd.generate_sjd(model, text[i : i + 1], window=5, cond_scale=2.0, generator=[g])
        assert torch.equal(alone[0], batched[i]), i


def test_token_shift_is_refused_in_one_line():
    model = peaked(DALLEConfig(**BASE, shift_tokens=True))
    with pytest.raises(ValueError, match="--decoding sjd does not support --shift_tokens"):
        generate_image_tokens(model, captions(model.cfg, 2), decoding="sjd")
