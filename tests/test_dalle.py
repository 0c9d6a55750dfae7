import pytest
import torch

from dalle_pytorch.dalle import DALLE, DALLEConfig
from dalle_pytorch.sampling import filter_logits, generate_image_tokens
from dalle_pytorch.tokenizer import ByteTokenizer, HugTokenizer, YttmTokenizer, tokenizer_from_dict
from dalle_pytorch.transformer import ATTN_TYPES

T, F, VT, VI = 6, 4, 20, 12


def model(**kw):
    torch.manual_seed(0)
    cfg = DALLEConfig(
        dim=32,
        depth=2,
        heads=2,
        dim_head=16,
        text_seq_len=T,
        num_text_tokens=VT,
        num_image_tokens=VI,
        image_fmap_size=F,
        **kw,
    )
    return DALLE(cfg).eval()


def batch(b=2):
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, VT, (b, T), generator=g), torch.randint(0, VI, (b, F * F), generator=g)


VARIANTS = [dict(attn_types=[t]) for t in ATTN_TYPES] + [
    dict(rotary_emb=True),
    dict(shift_tokens=True),
    dict(stable=True, sandwich_norm=True, qk_norm=True),
    dict(attn_types=["full", "axial_row", "axial_col", "conv_like"], shift_tokens=True, rotary_emb=True),
]


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_causality(kw):
    m = model(**kw)
    text, image = batch()
    base = m.logits(text, image)
    n = base.shape[1]
    for t in (2, T, T + 3, n - 2):
        seq = torch.cat([text, image], 1).clone()  # the full sequence; input position p holds seq[p - 1]
        seq[:, t:] = (seq[:, t:] + 1) % VI  # change every token from sequence index t on
        changed = m.logits(seq[:, :T], seq[:, T:])
        # input position p sees tokens up to sequence index p - 1, so positions <= t are unaffected
        assert torch.equal(torch.isinf(base[:, : t + 1]), torch.isinf(changed[:, : t + 1]))
        torch.testing.assert_close(base[:, : t + 1], changed[:, : t + 1])


def test_logits_mask():
    m = model()
    logits = m.logits(*batch())
    assert torch.isinf(logits[:, :T, VT:]).all() and torch.isfinite(logits[:, :T, :VT]).all()
    assert torch.isinf(logits[:, T:, :VT]).all() and torch.isfinite(logits[:, T:, VT:]).all()


def test_padding_has_no_loss():
    m = model()
    text, image = batch()
    text[:, 3:] = 0
    other = text.clone()
    loss, metrics = m(text, image)
    # the text loss only counts non-padding targets: changing what follows padding changes nothing
    assert torch.isfinite(loss)
    text_logits = m.logits(text, image)[:, :T, :VT]
    manual = torch.nn.functional.cross_entropy(text_logits[:, :3].transpose(1, 2), text[:, :3])
    torch.testing.assert_close(metrics["text_loss"], manual)
    assert torch.equal(text, other)


def test_z_loss_and_null_cond():
    m = model(z_loss_weight=1e-3, null_cond_prob=0.5).train()
    loss, metrics = m(*batch())
    assert "z_loss" in metrics and torch.isfinite(loss)
    loss.backward()


@pytest.mark.parametrize("kw", [{}, dict(shift_tokens=True, rotary_emb=True, attn_types=["axial_row", "conv_like"])])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cached_equals_uncached(kw, temperature):
    m = model(**kw)
    text, _ = batch()
    out = [
        generate_image_tokens(m, text, temperature=temperature, generator=torch.Generator().manual_seed(5), use_cache=c)
        for c in (True, False)
    ]
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_static_decode_step_equals_decode_one_token(kw):
    """decode_step (tensor position, whole static cache, for torch.compile) gives decode_one_token's logits
    at every position, with every attention type, rotary positions and token shift."""
    m = model(**kw)
    text, image = batch()
    caches = [m.new_cache(2, "cpu") for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            m.prefill(text, cache)
        for k in range(1, F * F):
            sliced = m.decode_one_token(text, image[:, :k], caches[0])
            static = m.decode_step(image[:, k - 1], torch.tensor(T + k), caches[1])
            torch.testing.assert_close(static, sliced, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiled_decode_gives_the_same_tokens():
    m = model(shift_tokens=True, rotary_emb=True, attn_types=["full", "axial_row"])
    text, _ = batch()
    out = [generate_image_tokens(m, text, generator=torch.Generator().manual_seed(5), compile=c) for c in (False, True)]
    assert torch.equal(out[0], out[1])


def test_priming_keeps_the_prime():
    m = model()
    text, image = batch()
    out = generate_image_tokens(m, text, prime=image[:, :5], generator=torch.Generator().manual_seed(0))
    assert torch.equal(out[:, :5], image[:, :5]) and out.shape == image.shape


def test_guidance_changes_logits_and_keeps_prompt():
    m = model()
    text, _ = batch()
    before = text.clone()
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    plain = generate_image_tokens(m, text, temperature=0, generator=g())
    guided = generate_image_tokens(m, text, temperature=0, cond_scale=5.0, generator=g())
    assert torch.equal(text, before)
    assert not torch.equal(plain, guided)
    # guided logits really differ from conditional ones at the first step
    cond = m.next_image_logits_uncached(text, text.new_zeros(2, 0))
    uncond = m.next_image_logits_uncached(torch.zeros_like(text), text.new_zeros(2, 0))
    assert not torch.allclose(cond, uncond + (cond - uncond) * 5.0)


def test_top_k_top_p_keep_exactly_the_allowed_set():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    assert torch.isfinite(filter_logits(logits, top_k=2)).tolist() == [[True, True, False, False, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.6)).tolist() == [[True, True, False, False, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.5)).tolist() == [[True, False, False, False, False]]
    shuffled = logits[:, [3, 0, 4, 1, 2]]
    assert torch.isfinite(filter_logits(shuffled, top_p=0.8)).tolist() == [[False, True, False, True, True]]


def test_same_seed_same_tokens():
    m = model()
    text, _ = batch()
    a = generate_image_tokens(m, text, generator=torch.Generator().manual_seed(9))
    b = generate_image_tokens(m, text, generator=torch.Generator().manual_seed(9))
    assert torch.equal(a, b)


def test_tokenizers_round_trip(tmp_path):
    captions = ["a small red circle on the left", "a big blue square above a tiny green triangle"] * 50
    yttm = YttmTokenizer.train(captions, 60, str(tmp_path / "bpe.yttm"))
    byte = ByteTokenizer()
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE(unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.train_from_iterator(captions, trainers.BpeTrainer(vocab_size=80, special_tokens=["[UNK]"]))
    hug = HugTokenizer(hf.to_str())
    for tok in (yttm, byte, hug):
        ids, cut = tok.tokenize(captions[1], 64)
        assert cut == 0 and ids.shape == (1, 64)
        text = tok.decode([i for i in ids[0].tolist() if i])
        assert text.replace(" ", "") == captions[1].replace(" ", "")
        again = tokenizer_from_dict(tok.to_dict())
        assert torch.equal(again.tokenize(captions[1], 64)[0], ids)


def test_truncation_is_counted_or_refused():
    tok = ByteTokenizer()
    ids, cut = tok.tokenize(["x" * 50, "short"], 10)
    assert cut == 1 and ids.shape == (2, 10)
    with pytest.raises(ValueError, match="text_seq_len"):
        tok.tokenize("x" * 50, 10, truncate=False)
