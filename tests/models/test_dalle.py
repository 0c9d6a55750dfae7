import pytest
import torch

from dalle_pytorch.data.tokenizer import ByteTokenizer, HugTokenizer, YttmTokenizer, tokenizer_from_dict
from dalle_pytorch.models.dalle import DALLE, DALLEConfig
from dalle_pytorch.models.sampling import filter_logits, generate_image_tokens, generate_text_tokens, pick_token
from dalle_pytorch.models.transformer import ATTN_TYPES, shift_tokens

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
    dict(attn_types=["full", "axial_row", "axial_col", "conv_like", "sparse"], shift_tokens=True, rotary_emb=True),
    # Llama's blocks: RMSNorm, SwiGLU, grouped-query attention (one key/value head for the two query heads)
    dict(norm="rmsnorm", ff="swiglu", kv_heads=1, rotary_emb=True),
    dict(attn_types=["full", "axial_row", "sparse"], norm="rmsnorm", ff="swiglu", kv_heads=1, qk_norm=True),
]


def variant_id(kw):
    return "-".join(f"{k}={v}" for k, v in kw.items())


def assert_depends_from(base, changed, t):
    """Logits (b, n, V) of two sequences that differ from sequence index t on: input position p holds
    sequence index p - 1, so positions <= t must be unchanged and every later position must change."""
    torch.testing.assert_close(base[:, : t + 1], changed[:, : t + 1])  # -inf entries must match too
    diff = (base.nan_to_num() - changed.nan_to_num()).abs().amax(dim=-1)  # (b, n); -inf - -inf counts as 0
    later = diff[:, t + 1 :]
    assert (later > 1e-5).all(), f"positions after {t} ignore the change: {later.tolist()}"


@pytest.mark.parametrize("kw", VARIANTS, ids=variant_id)
def test_causality(kw):
    m = model(**kw)
    text, image = batch()
    seq = torch.cat([text, image], 1)  # the full sequence
    base = m.logits(text, image)
    n = base.shape[1]
    for t in (2, T, T + 3, n - 2):
        changed = seq.clone()
        changed[:, t:] = (changed[:, t:] + 1) % VI  # change every token from sequence index t on
        assert_depends_from(base, m.logits(changed[:, :T], changed[:, T:]), t)
    for t in (0, T - 1):  # one caption token: every later position sees all of the text, in every pattern
        changed = seq.clone()
        changed[:, t] = changed[:, t] % (VT - 1) + 1
        assert_depends_from(base, m.logits(changed[:, :T], changed[:, T:]), t)


def test_token_shift_reads_previous_left_and_above():
    # text_len 2, a 3x3 image: position 0 is bos, 1-2 text, 3-10 image tokens 0-7 (rows of 3).
    # Each position's features are its position + 1, so 0 means "no neighbour".
    x = torch.arange(1.0, 12.0)[None, :, None].expand(1, 11, 8)
    prev_or_left = [0, 1, 2, 0, 4, 5, 0, 7, 8, 0, 10]  # text: previous token; image: the one to the left
    self_or_above = [1, 2, 3, 0, 0, 0, 4, 5, 6, 7, 8]  # text: itself; image: the one above
    want = torch.tensor([prev_or_left] * 2 + [self_or_above] * 2 + [list(range(1, 12))] * 4).T[None].float()
    torch.testing.assert_close(shift_tokens(x, torch.arange(11), 2, 3), want)
    for p in range(11):  # one position, as decoding asks for it
        torch.testing.assert_close(shift_tokens(x, torch.tensor([p]), 2, 3), want[:, p : p + 1])


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


@pytest.mark.parametrize(
    "kw", [{}, dict(shift_tokens=True, rotary_emb=True, attn_types=["axial_row", "conv_like", "sparse"])]
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cached_equals_uncached(kw, temperature):
    m = model(**kw)
    text, _ = batch()
    out = [
        generate_image_tokens(m, text, temperature=temperature, generator=torch.Generator().manual_seed(5), use_cache=c)
        for c in (True, False)
    ]
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("prime", [0, 5])
@pytest.mark.parametrize("kw", VARIANTS, ids=variant_id)
def test_prefill_and_decode_step_equal_the_full_forward(kw, prime):
    """prefill, then decode_step one token at a time over the static cache, gives at every position the
    logits of one full forward, with every attention type and option."""
    m = model(**kw)
    text, image = batch()
    full = m.logits(text, image)[:, T:, VT:]  # (b, I, VI): position T + k predicts image token k
    cache = m.new_cache(2, "cpu")
    with torch.no_grad():
        got = [m.prefill(text, cache, image[:, :prime] if prime else None)]
        for k in range(prime, F * F - 1):
            got.append(m.decode_step(image[:, k], torch.tensor(T + 1 + k), cache))
    for k, logits in enumerate(got, start=prime):
        torch.testing.assert_close(logits, full[:, k], rtol=1e-4, atol=1e-5, msg=lambda s, k=k: f"token {k}: {s}")


@pytest.mark.slow
def test_compiled_decode_gives_the_same_tokens_with_one_graph():
    from torch._dynamo.utils import counters

    m = model(shift_tokens=True, rotary_emb=True, attn_types=["full", "axial_row"])
    text, _ = batch()
    eager = generate_image_tokens(m, text, generator=torch.Generator().manual_seed(5))
    graphs = counters["stats"]["unique_graphs"]
    compiled = generate_image_tokens(m, text, generator=torch.Generator().manual_seed(5), compile=True)
    assert torch.equal(eager, compiled)
    assert counters["stats"]["unique_graphs"] - graphs == 1  # one graph for every position: no recompiles


def test_compile_needs_the_cache():
    with pytest.raises(ValueError, match="use_cache=True"):
        generate_image_tokens(model(), batch()[0], use_cache=False, compile=True)


def test_priming_keeps_the_prime():
    m = model()
    text, image = batch()
    out = generate_image_tokens(m, text, prime=image[:, :5], generator=torch.Generator().manual_seed(0))
    assert torch.equal(out[:, :5], image[:, :5]) and out.shape == image.shape


def test_guidance_changes_tokens_and_keeps_prompt():
    m = model()
    text, _ = batch()
    before = text.clone()
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    plain = generate_image_tokens(m, text, temperature=0, generator=g())
    guided = generate_image_tokens(m, text, temperature=0, cond_scale=5.0, generator=g())
    assert torch.equal(text, before)
    assert not torch.equal(plain, guided)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_guidance_at_scale_zero_samples_the_unconditional_model(temperature):
    """cond_scale 0 keeps only the unconditional rows: the tokens of plain sampling from an empty caption."""
    m = model()
    text, _ = batch()
    g = lambda: torch.Generator().manual_seed(4)  # noqa: E731
    uncond = generate_image_tokens(m, torch.zeros_like(text), temperature=temperature, generator=g())
    guided = generate_image_tokens(m, text, temperature=temperature, cond_scale=0.0, generator=g())
    assert torch.equal(guided, uncond)
    # not vacuous: the caption changes greedy samples (at temperature 1 this untrained model's logits are
    # too flat for the caption to move the Gumbel-max picks)
    greedy = [generate_image_tokens(m, t, temperature=0, generator=g()) for t in (text, torch.zeros_like(text))]
    assert not torch.equal(*greedy)


def test_guidance_extrapolates_away_from_the_unconditional_logits():
    # cond prefers token 0, uncond token 2; token 1 gains most from the caption, so guidance at scale 3
    # picks it: uncond + 3 (cond - uncond) = [4, 5.7, -4]. Rows are [cond; uncond]; both continue with the pick.
    logits = torch.tensor([[2.0, 1.9, 0.0], [1.0, 0.0, 2.0]])
    noise = torch.zeros(())  # unused at temperature 0

    def pick(cond_scale):
        return pick_token(logits, noise, 0.0, 0, 1.0, cond_scale).tolist()

    assert pick(1.0) == [0, 2]  # no guidance: each row its own argmax
    assert pick(3.0) == [1, 1]
    assert pick(0.0) == [2, 2]  # the unconditional row alone


def test_top_k_top_p_keep_exactly_the_allowed_set():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    assert torch.isfinite(filter_logits(logits, top_k=2)).tolist() == [[True, True, False, False, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.6)).tolist() == [[True, True, False, False, False]]
    # 0.45, not 0.5: the first token's 0.5 is the mass before the second, and one ulp decides a tie
    assert torch.isfinite(filter_logits(logits, top_p=0.45)).tolist() == [[True, False, False, False, False]]
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


def test_attn_types_accept_the_comma_separated_form():
    assert DALLEConfig(attn_types=["full,axial_row"]).attn_types == ["full", "axial_row"]
    assert DALLEConfig(attn_types=["full", "conv_like"]).attn_types == ["full", "conv_like"]
    with pytest.raises(ValueError, match="unknown type 'sparse_ish'"):
        DALLEConfig(attn_types=["full,sparse_ish"])


@pytest.mark.parametrize("reference_layout", [False, True])
def test_generate_text_keeps_the_prompt_and_ends_at_padding(reference_layout):
    """--gentxt: the given tokens stay, the model continues them, and a row ends at the first padding it samples
    (0, or with the predecessor's layout any of the per-position padding ids)."""
    dalle = model(reference_layout=reference_layout)
    pad = VT - T if reference_layout else 0  # a padding id the model may sample
    stop_at = {0: 5, 1: 3}  # row -> position where the model samples padding

    def text_logits(text):
        logits = torch.full((text.shape[0], T, VT), -10.0)
        for p in range(T):
            logits[:, p, 7 + p % 3] = 10.0  # a word
            for row, at in stop_at.items():
                if p == at:
                    logits[row, p, :] = -10.0
                    logits[row, p, pad] = 10.0
        return logits

    dalle.text_logits = text_logits
    prompt = torch.zeros(2, T, dtype=torch.long)
    prompt[0, :2] = torch.tensor([3, 4])  # row 1: no prompt, the model invents the caption
    out = generate_text_tokens(dalle, prompt, temperature=0)
    assert out[0, :5].tolist() == [3, 4, 9, 7, 8] and (out[0, 5:] == 0).all()
    assert out[1, :3].tolist() == [7, 8, 9] and (out[1, 3:] == 0).all()


def test_text_logits_are_the_training_text_positions():
    dalle = model()
    text, image = batch()
    torch.testing.assert_close(dalle.text_logits(text), dalle.logits(text, image)[:, :T, :VT])


def test_layers_with_the_same_id_share_their_modules():
    shared = model(shared_attn_ids=["0,0,1"], shared_ff_ids=["x"])  # depth 2: ids cycle as 0, 0 / x, x
    a, b = shared.transformer.layers
    assert a.attn is b.attn and a.ff is b.ff and a.norm1 is not b.norm1
    assert sum(p.numel() for p in shared.parameters()) < sum(p.numel() for p in model().parameters())
    text, image = batch()
    loss, _ = shared.train()(text, image)
    loss.backward()
    assert all(p.grad is not None for p in shared.parameters())
    again = DALLE(shared.cfg).eval()
    again.load_state_dict(shared.state_dict())
    assert again.transformer.layers[0].attn is again.transformer.layers[1].attn
    torch.testing.assert_close(again.logits(text, image), shared.eval().logits(text, image))


def test_sharing_refuses_layers_of_different_types_and_fsdp():
    from distributed.torch_fsdp import _check_unshared

    with pytest.raises(ValueError, match="--shared_attn_ids: layer 1 .axial_row. would share"):
        model(attn_types=["full", "axial_row"], shared_attn_ids=["0"])
    with pytest.raises(ValueError, match="--distributed_backend fsdp shards each block"):
        _check_unshared(model(shared_ff_ids=["0"]).transformer.layers)
    _check_unshared(model().transformer.layers)


def test_a_pattern_that_does_not_fit_the_image_grid_is_refused():
    """conv_like's 5x5 window covers a 3x3 grid, and nothing is sparse about one image token."""
    with pytest.raises(ValueError, match="--attn_types conv_like does not fit a 3x3 image token grid"):
        DALLEConfig(attn_types=["full", "conv_like"], image_fmap_size=3)
    with pytest.raises(ValueError, match="--attn_types axial_row does not fit a 1x1"):
        DALLEConfig(attn_types=["axial_row"], image_fmap_size=1)
    DALLEConfig(attn_types=["conv_like"], image_fmap_size=4)


@pytest.mark.parametrize("flag", ["depth", "heads", "dim_head"])
def test_a_model_needs_blocks_and_heads(flag):
    with pytest.raises(ValueError, match=f"--{flag} must be at least 1 .got 0."):
        DALLEConfig(**{flag: 0})


@pytest.mark.parametrize("cond_scale", [1.0, 3.0])
def test_a_row_with_its_own_generator_draws_the_same_alone_or_batched(cond_scale):
    """One generator per row (what a service batching requests passes): each row's tokens are those it draws
    alone with a generator of the same seed, whichever rows share its batch (here 4 captions, seeds 7..10)."""
    m = model()
    text = torch.cat([batch(2)[0], batch(2)[0].flip(0)])
    seeds = [7, 8, 9, 10]
    together = generate_image_tokens(
        m, text, cond_scale=cond_scale, generator=[torch.Generator().manual_seed(s) for s in seeds]
    )
    for i, s in enumerate(seeds):
        alone = generate_image_tokens(
            m, text[i : i + 1], cond_scale=cond_scale, generator=torch.Generator().manual_seed(s)
        )
        assert torch.equal(together[i : i + 1], alone), i
    with pytest.raises(ValueError, match="3 generators for 4 caption rows"):
        generate_image_tokens(m, text, generator=[torch.Generator() for _ in range(3)])


def test_llama_blocks_have_llamas_widths_and_a_grouped_cache():
    from dalle_pytorch.models.layers import SwiGLU, swiglu_hidden

    assert swiglu_hidden(4096, 4, 256) == 11008  # Llama 7B
    assert swiglu_hidden(1280, 4, 256) == 3584  # LlamaGen's GPT-XL
    m = model(norm="rmsnorm", ff="swiglu", kv_heads=1, ff_multiple_of=8)
    block = m.transformer.layers[0]
    assert isinstance(block.norm1, torch.nn.RMSNorm) and isinstance(m.norm, torch.nn.RMSNorm)
    assert isinstance(block.ff, SwiGLU) and block.ff.w1.out_features == 88 and block.ff.w1.bias is None
    assert block.attn.to_qkv.out_features == (2 + 2 * 1) * 16
    cache = m.new_cache(3, "cpu")
    assert cache.layers[0].k.shape == (3, 1, m.cfg.seq_len, 16)  # one key/value head, not two


@pytest.mark.parametrize("bad", [dict(kv_heads=3), dict(kv_heads=-1), dict(norm="batchnorm"), dict(ff="relu")])
def test_llama_options_refuse_what_cannot_be_built(bad):
    with pytest.raises(ValueError, match="--kv_heads|--norm|--ff"):
        model(**bad)
