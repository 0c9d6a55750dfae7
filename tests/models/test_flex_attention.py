"""The sparse patterns through FlexAttention (the CUDA path) equal SDPA with the dense mask: over the whole
sequence and one decode row at a time, tiles skipped, whole and partial. Run here with flex's compiled CPU
forward (flex has no CPU backward: bench/gpu.py checks the gradients on a GPU)."""

import pytest
import torch
import torch.nn.functional as F

from dalle_pytorch.models import flex
from dalle_pytorch.models.transformer import ATTN_TYPES, attention_mask

pytestmark = pytest.mark.skipif(flex.flex_attention is None, reason="torch < 2.5 has no FlexAttention")
SPARSE = [t for t in ATTN_TYPES if t != "full"]


@pytest.fixture
def flex_on_cpu(monkeypatch):
    monkeypatch.setattr(flex, "DEVICES", ("cuda", "cpu"))


def qkv(n, b=2, h=3, d=16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, h, n, d, generator=g) for _ in range(3)]


@pytest.mark.parametrize("kind", SPARSE)
@pytest.mark.parametrize("text_len, fmap, block", [(8, 8, 16), (16, 16, 128), (5, 6, (32, 16))])
def test_flex_equals_the_dense_mask(kind, text_len, fmap, block):
    mask = attention_mask(kind, text_len, fmap)
    layout = flex.FlexLayout(mask, block)
    assert layout.computed_fraction < 1  # some tiles are skipped
    q, k, v = qkv(mask.shape[0])
    with torch.no_grad():
        torch.testing.assert_close(
            flex.attend(q, k, v, layout), F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        )
        for pos in (0, text_len, text_len + 1, block if isinstance(block, int) else 32, mask.shape[0] - 1):
            row = flex.attend(q[:, :, pos : pos + 1], k, v, layout, torch.tensor(pos))
            want = F.scaled_dot_product_attention(q[:, :, pos : pos + 1], k, v, attn_mask=mask[pos : pos + 1])
            torch.testing.assert_close(row, want, msg=lambda s, pos=pos: f"decode row {pos}: {s}")


def test_the_tiles_are_the_dense_masks():
    """A tile is skipped exactly where the mask is all False in it, and whole (no mask read) where all True."""
    mask = attention_mask("conv_like", 8, 8)
    layout = flex.FlexLayout(mask, 16)
    n_tiles = -(-mask.shape[0] // 16)
    padded = torch.zeros(n_tiles * 16, n_tiles * 16, dtype=torch.bool)
    padded[: mask.shape[0], : mask.shape[0]] = mask
    tiles = padded.view(n_tiles, 16, n_tiles, 16).transpose(1, 2)
    listed = torch.zeros(n_tiles, n_tiles, dtype=torch.bool)
    full = torch.zeros(n_tiles, n_tiles, dtype=torch.bool)
    for r in range(n_tiles):
        listed[r, layout.kv_indices[0, 0, r, : layout.kv_num_blocks[0, 0, r]]] = True
        full[r, layout.full_kv_indices[0, 0, r, : layout.full_kv_num_blocks[0, 0, r]]] = True
    assert torch.equal(listed | full, tiles.any(-1).any(-1))
    inside = torch.ones_like(padded)
    inside[mask.shape[0] :], inside[:, mask.shape[0] :] = False, False
    whole = (tiles | ~inside.view(n_tiles, 16, n_tiles, 16).transpose(1, 2)).all(-1).all(-1)
    assert torch.equal(full, whole & tiles.any(-1).any(-1))


def test_the_model_decodes_through_flex_as_through_the_dense_mask(flex_on_cpu, monkeypatch):
    """A DALLE with every sparse pattern, its tiles 16 positions wide (3 per side): the full forward's logits
    equal the fused pieces', and prefill + decode_step through flex give the full forward's logits at every
    position."""
    from dalle_pytorch.models.dalle import DALLE, DALLEConfig

    monkeypatch.setattr(flex, "BLOCK", 16)
    cfg = DALLEConfig(dim=32, depth=4, heads=2, dim_head=16, text_seq_len=6, num_text_tokens=20, num_image_tokens=12,
                      image_fmap_size=6, attn_types=SPARSE, rotary_emb=True, shift_tokens=True)  # fmt: skip
    torch.manual_seed(0)
    model = DALLE(cfg).eval()
    assert all(layout.flex is not None for layout in model.transformer.layouts.values())
    g = torch.Generator().manual_seed(1)
    text, image = torch.randint(1, 20, (2, 6), generator=g), torch.randint(0, 12, (2, 36), generator=g)
    with torch.no_grad():
        full = model.logits(text, image)[:, 6:, 20:]
        monkeypatch.setattr(flex, "DEVICES", ("cuda",))  # the CPU's own sparse pieces
        torch.testing.assert_close(full, model.logits(text, image)[:, 6:, 20:])
        monkeypatch.setattr(flex, "DEVICES", ("cuda", "cpu"))
        cache = model.new_cache(2, "cpu")
        got = [model.prefill(text, cache)]
        for k in range(35):
            got.append(model.decode_step(image[:, k], torch.tensor(6 + 1 + k), cache))
    for k, logits in enumerate(got):
        torch.testing.assert_close(logits, full[:, k], rtol=1e-4, atol=1e-5, msg=lambda s, k=k: f"token {k}: {s}")


def test_tiles_narrower_than_16_are_refused():
    with pytest.raises(ValueError, match="at least 16 positions wide"):
        flex.FlexLayout(attention_mask("axial_row", 5, 6), (16, 8))


def test_not_on_the_cpu_by_default():
    assert flex.DEVICES == ("cuda",)
    q = torch.zeros(1, 1, 4, 16)
    layout = flex.FlexLayout(attention_mask("axial_row", 2, 2), 16) if flex.flex_attention else None
    assert not flex.serves(q, layout) and not flex.serves(q.cuda() if torch.cuda.is_available() else q, None)
