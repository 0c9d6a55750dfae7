"""The sparse patterns computed sparsely equal SDPA with their dense masks: outputs and gradients."""

import os

import pytest
import torch
import torch.nn.functional as F
from launch import assert_same, dalle_args, grad_norms, launch

from dalle_pytorch.files import safe_load
from dalle_pytorch.models.sparse_attention import SparseLayout, _FlashPieces, _sparse_attention_ops, sparse_attention
from dalle_pytorch.models.transformer import ATTN_TYPES, attention_mask

SPARSE = [t for t in ATTN_TYPES if t != "full"]


def qkv(n, b=2, h=3, d=16, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, h, n, d, generator=g, dtype=dtype, requires_grad=True) for _ in range(3)]


# the CPU's fused pieces, and the plain ops every other device (and attention dropout) uses
IMPLEMENTATIONS = {"flash_pieces": _FlashPieces.apply, "ops": _sparse_attention_ops}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", SPARSE)
@pytest.mark.parametrize("text_len, fmap", [(5, 4), (8, 6), (3, 8)])
def test_sparse_path_equals_the_dense_mask(kind, text_len, fmap, impl):
    mask = attention_mask(kind, text_len, fmap)
    layout = SparseLayout(kind, mask, text_len, fmap)
    q, k, v = qkv(mask.shape[0])
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    sparse = IMPLEMENTATIONS[impl](q, k, v, layout)
    torch.testing.assert_close(sparse, dense)
    g = torch.randn_like(dense)
    grads_dense = torch.autograd.grad(dense, (q, k, v), g)
    grads_sparse = torch.autograd.grad(sparse, (q, k, v), g)
    for a, e in zip(grads_sparse, grads_dense):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("layout_of", ["model", "strided_last_dim"])
def test_any_memory_layout_gives_the_dense_masks_result(layout_of):
    """q, k, v as the model makes them (views of one (b, n, 3, h, d) projection), and with a strided last
    dimension, which the flash kernel would misread (the dispatch sends it to the plain ops)."""
    mask = attention_mask("axial_col", 5, 4)
    layout = SparseLayout("axial_col", mask, 5, 4)
    b, h, n, d = 2, 3, mask.shape[0], 16
    x = torch.randn(b, n, 3, h, d, dtype=torch.float64, requires_grad=True)
    if layout_of == "model":
        q, k, v = x.view(b, n, 3, h, d).permute(2, 0, 3, 1, 4)
    else:
        q, k, v = x.permute(2, 0, 3, 4, 1).contiguous().transpose(-1, -2)  # (b, h, n, d), last stride n
        assert q.stride(-1) != 1
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    sparse = sparse_attention(q, k, v, layout)
    torch.testing.assert_close(sparse, dense)
    g = torch.randn_like(dense)
    torch.testing.assert_close(torch.autograd.grad(sparse, x, g)[0], torch.autograd.grad(dense, x, g)[0])


def test_the_cpu_takes_the_fused_pieces_unless_there_is_dropout(monkeypatch):
    mask = attention_mask("axial_row", 5, 4)
    layout = SparseLayout("axial_row", mask, 5, 4)
    q, k, v = qkv(mask.shape[0])
    taken = []
    monkeypatch.setattr(_FlashPieces, "apply", lambda *a: taken.append(1) or _sparse_attention_ops(*a))
    sparse_attention(q, k, v, layout)
    sparse_attention(q, k, v, layout, dropout=0.1)
    assert taken == [1]


@pytest.mark.parametrize("kind", SPARSE)
def test_the_fused_pieces_in_bf16(kind):
    """bf16 q, k, v (what autocast gives without --qk_norm) run in the fused kernel's bf16 path; the merge of
    the pieces happens in fp32."""
    mask = attention_mask(kind, 8, 6)
    layout = SparseLayout(kind, mask, 8, 6)
    q, k, v = qkv(mask.shape[0], dtype=torch.float32)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
    q16, k16, v16 = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    out = sparse_attention(q16, k16, v16, layout)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)
    for a, e in zip(torch.autograd.grad(out.float().sum(), (q16, k16, v16)), expected_grads):
        torch.testing.assert_close(a.float(), e, atol=6e-2, rtol=6e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_with_fp32_queries_and_keys(dtype):
    """On CUDA, autocast keeps --qk_norm's LayerNorm in fp32 while the matmuls run in 16 bits: the masking
    must not assume the scores have q's dtype."""
    mask = attention_mask("sparse", 5, 4)
    layout = SparseLayout("sparse", mask, 5, 4)
    q, k, v = qkv(mask.shape[0], dtype=torch.float32)
    with torch.autocast("cpu", dtype=dtype):
        out = sparse_attention(q, k, v.to(dtype), layout)
    out.float().sum().backward()
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    assert all(torch.isfinite(t.grad).all() for t in (q, k))


@pytest.mark.parametrize("kind", SPARSE)
def test_the_layout_computes_a_fraction_of_full_causal_at_the_dalle_shape(kind):
    """At text 256 + 32x32 image tokens every pattern computes well under the ~50% of the scores that
    full causal attention does (the text keys every image query sees are most of what is left)."""
    layout = SparseLayout(kind, attention_mask(kind, 256, 32), 256, 32)
    assert layout.computed_fraction < 0.25


def test_sparse_is_the_strided_pattern():
    """`sparse`: an image query sees all text, itself, the previous image-width tokens and its column."""
    text_len, fmap = 4, 4
    mask = attention_mask("sparse", text_len, fmap)
    t = 10  # image query predicting token (2, 2); query position text_len + t
    keys = mask[text_len + t].nonzero().flatten().tolist()
    image_keys = [p - text_len - 1 for p in keys if p > text_len]
    assert keys[: text_len + 1] == list(range(text_len + 1))
    assert image_keys == [2, 6, 7, 8, 9]  # column 2 (rows 0, 1) and tokens 6..9 (itself is token 9)


SPARSE_TYPES = ["--attn_types", "axial_row,axial_col,conv_like,sparse", "--depth", "4"]


@pytest.fixture(scope="module")
def sparse_reference(vae_path, tmp_path_factory):
    import train_dalle

    path = str(tmp_path_factory.mktemp("sparse_ref"))
    weights = safe_load(train_dalle.main(dalle_args(vae_path, path, 8, extra=SPARSE_TYPES)))["weights"]
    return weights, grad_norms(os.path.join(path, "dalle"))


@pytest.mark.launcher
@pytest.mark.parametrize(
    "kind,extra", [("torchrun-fsdp", ["--distributed_backend", "fsdp"]), ("deepspeed", ["--zero_stage", "3"])]
)
def test_two_ranks_train_the_patterns_as_one_process(kind, extra, vae_path, sparse_reference, tmp_path):
    """The layouts are buffers of the model: sharded wrappers move them with it and leave them whole."""
    launch(kind, "train_dalle.py", dalle_args(vae_path, str(tmp_path), 4, extra=[*SPARSE_TYPES, *extra]))
    run = os.path.join(tmp_path, "dalle")
    weights, norms = sparse_reference
    assert grad_norms(run) == pytest.approx(norms, rel=1e-4)
    assert_same(weights, safe_load(os.path.join(run, "dalle.safetensors"))["weights"])
