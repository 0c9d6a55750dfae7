"""A DALLE that reads captions through a frozen encoder: features (b, T, D) with zero vectors at padding."""

import pytest
import torch

from dalle_pytorch.models.dalle import DALLE, DALLEConfig
from dalle_pytorch.models.sampling import generate_image_tokens, generate_text_tokens

T, F, VI, D = 6, 4, 12, 8
LLAMA = dict(norm="rmsnorm", ff="swiglu", kv_heads=1, rotary_emb=True, ff_multiple_of=8)


def model(**kw):
    torch.manual_seed(0)
    cfg = DALLEConfig(
        dim=32, depth=2, heads=2, dim_head=16, text_seq_len=T, num_text_tokens=0, num_image_tokens=VI,
        image_fmap_size=F, text_feature_dim=D, **kw,
    )  # fmt: skip
    return DALLE(cfg).eval()


def batch(lengths=(2, 6, 0)):
    """Captions of the given numbers of real tokens (0: no caption), the rest zero vectors; image tokens."""
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(len(lengths), T, D, generator=g)
    for i, n in enumerate(lengths):
        feats[i, n:] = 0
    return feats, torch.randint(0, VI, (len(lengths), F * F), generator=g)


@pytest.mark.parametrize("kw", [{}, LLAMA, dict(attn_types=["full", "axial_row", "sparse"], shift_tokens=True)])
def test_padding_is_never_read_and_null_rows_read_the_null_caption(kw):
    m = model(**kw)
    feats, image = batch()
    base = m.logits(feats, image)[:, T:]
    with torch.no_grad():  # what sits at a padding position: its learned position (or a rotary angle) alone
        m.caption_proj[2].bias.add_(1.0)  # changes every real position's input, and the padding's would
    moved = m.logits(feats, image)[:, T:]
    assert not torch.allclose(base[:2], moved[:2])  # the captions are read
    torch.testing.assert_close(base[2], moved[2])  # a row without caption reads the null caption, not the proj
    m2 = model(**kw)
    if not kw.get("rotary_emb"):
        with torch.no_grad():
            m2.text_pos.weight[1 + 2 :].add_(5.0)  # positions of row 0's padding (row 1 has none)
        out = m2.logits(feats, image)[:, T:]
        torch.testing.assert_close(out[0], base[0])
        assert not torch.allclose(out[1], base[1])
    with torch.no_grad():
        m2.null_caption.add_(1.0)
    assert not torch.allclose(m2.logits(feats, image)[2, T:], base[2])


@pytest.mark.parametrize("kw", [{}, LLAMA])
def test_features_train_with_an_image_loss_and_every_parameter_in_the_graph(kw):
    m = model(null_cond_prob=0.5, **kw).train()
    feats, image = batch()
    loss, metrics = m(feats, image)
    assert set(metrics) == {"image_loss"}
    loss.backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None]
    assert not missing, f"no gradient (DDP would hang on them): {missing}"


@pytest.mark.parametrize("kw", [{}, LLAMA, dict(attn_types=["axial_row", "conv_like"], shift_tokens=True)])
@pytest.mark.parametrize("cond_scale", [1.0, 3.0])
def test_cached_decoding_equals_recomputation(kw, cond_scale):
    m = model(**kw)
    feats, _ = batch()
    out = [
        generate_image_tokens(
            m, feats, temperature=1.0, cond_scale=cond_scale, generator=torch.Generator().manual_seed(5), use_cache=c
        )
        for c in (True, False)
    ]
    assert torch.equal(out[0], out[1])


def test_prefill_and_decode_equal_the_full_forward():
    m = model(**LLAMA)
    feats, image = batch()
    full = m.logits(feats, image)[:, T:]
    cache = m.new_cache(3, "cpu")
    with torch.no_grad():
        got = [m.prefill(feats, cache)]
        got += [m.decode_step(image[:, k], torch.tensor(T + 1 + k), cache) for k in range(F * F - 1)]
    for k, logits in enumerate(got):
        torch.testing.assert_close(logits, full[:, k], rtol=1e-4, atol=1e-5)


def test_ids_where_features_go_and_caption_prediction_are_refused():
    m = model()
    with pytest.raises(ValueError, match="caption features"):
        m.logits(torch.ones(2, T, dtype=torch.long), torch.zeros(2, F * F, dtype=torch.long))
    with pytest.raises(ValueError, match="--gentxt"):
        generate_text_tokens(m, torch.zeros(1, 0, dtype=torch.long))
