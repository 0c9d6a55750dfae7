"""The decoder-only transformer under DALLE: pre-norm blocks, SDPA attention with sparse causal masks,
rotary positions, token shift, and the stabilizers users know (CogView's, sandwich norm, QK-norm).

The sequence is [<bos>, text (text_seq_len), image (fmap^2)] minus its last token. Masks are built once
per attention type from the layout; the KV cache lets generation decode one token per step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

ATTN_TYPES = ("full", "axial_row", "axial_col", "conv_like")


def attention_mask(kind: str, text_len: int, fmap: int, kernel: int = 5) -> torch.Tensor:
    """(n, n) bool, True where query i may attend key j; n = text_len + fmap**2 (bos + text + image - 1).

    Positions 0..text_len hold bos and text; position text_len + 1 + k holds image token k. The query at
    position q >= text_len predicts image token t = q - text_len; sparse patterns keep the image keys that
    share its row (axial_row), its column (axial_col) or a kernel window around it (conv_like). Every
    query sees all text and itself, and nothing after itself.
    """
    if kind not in ATTN_TYPES:
        raise ValueError(f"unknown attention type {kind!r}: use one of {', '.join(ATTN_TYPES)}")
    n = text_len + fmap * fmap
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    if kind == "full":
        return causal
    pos = torch.arange(n)
    target = (pos - text_len).clamp(min=0)  # image index each query predicts
    key_img = pos - text_len - 1  # image index each key holds (negative for text keys)
    tr, tc = target // fmap, target % fmap
    kr, kc = key_img.clamp(min=0) // fmap, key_img.clamp(min=0) % fmap
    if kind == "axial_row":
        same = tr[:, None] == kr[None, :]
    elif kind == "axial_col":
        same = tc[:, None] == kc[None, :]
    else:
        r = kernel // 2
        same = ((tr[:, None] - kr[None, :]).abs() <= r) & ((tc[:, None] - kc[None, :]).abs() <= r)
    is_text_key = (key_img < 0)[None, :]
    image_query = (pos >= text_len)[:, None]
    allowed = torch.where(image_query, is_text_key | same, torch.ones_like(same))
    return causal & (allowed | torch.eye(n, dtype=torch.bool))


def rotary_angles(text_len: int, fmap: int, dim_head: int, theta: float = 10000.0) -> torch.Tensor:
    """(n, rot_dim // 2) angles: a third of the rotary dims for the 1-D text position, a third each for the
    image row and column (2-D axial). Text tokens sit at row/col -1; image tokens at text position text_len+1."""
    rot = (dim_head // 3) // 2 * 2
    half = rot // 2
    n = text_len + fmap * fmap
    pos = torch.arange(n)
    img = pos - text_len - 1
    text_pos = torch.where(img < 0, pos, torch.full_like(pos, text_len + 1)).float()
    row = torch.where(img < 0, torch.full_like(pos, -1), img.clamp(min=0) // fmap).float()
    col = torch.where(img < 0, torch.full_like(pos, -1), img.clamp(min=0) % fmap).float()
    freqs_text = 1.0 / theta ** (torch.arange(half) / half)
    freqs_pix = torch.linspace(1.0, fmap / 2, half) * math.pi / fmap  # pixel-style frequencies for a small grid
    return torch.cat([text_pos[:, None] * freqs_text, row[:, None] * freqs_pix, col[:, None] * freqs_pix], dim=-1)


def apply_rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate the first 2*angles.shape[-1] features of x (b, h, n, d) by `angles` (n, r)."""
    r = angles.shape[-1]
    rot, rest = x[..., : 2 * r], x[..., 2 * r :]
    x1, x2 = rot[..., :r], rot[..., r:]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)


def shift_tokens(x: torch.Tensor, text_len: int, fmap: int, start: int = 0) -> torch.Tensor:
    """Token shift (after lucidrains' DALLE-pytorch, itself after RWKV): mix in neighbours' features.

    x (b, m, d) holds positions start..start+m-1 of the whole history `x` (start > 0 only when decoding,
    where x is the full history and only the last row is returned). Text: a quarter of the features come
    from the previous token. Image: a quarter from the token to the left, a quarter from the token above.
    """
    n_hist, d = x.shape[1], x.shape[-1]
    q = d // 4
    pos = torch.arange(start, n_hist, device=x.device) if start else torch.arange(n_hist, device=x.device)
    img = pos - text_len - 1
    prev = (pos - 1).clamp(min=0)
    above = torch.where(img >= fmap, pos - fmap, pos)  # same position = no shift (zeroed below)
    left = torch.where((img >= 0) & (img % fmap != 0), pos - 1, pos)
    zero = torch.zeros_like(x[:, :1, :q])
    text_shift = torch.where((pos > 0)[None, :, None], x[:, prev, :q], zero)
    left_feat = torch.where((left != pos)[None, :, None], x[:, left, :q], zero)
    above_feat = torch.where((above != pos)[None, :, None], x[:, above, q : 2 * q], zero)
    cur = x[:, pos]
    is_img = (img >= 0)[None, :, None]
    first = torch.where(is_img, left_feat, text_shift)
    second = torch.where(is_img, above_feat, cur[..., q : 2 * q])
    return torch.cat([first, second, cur[..., 2 * q :]], dim=-1)


def shift_token_at(hist: torch.Tensor, pos: torch.Tensor, text_len: int, fmap: int) -> torch.Tensor:
    """shift_tokens for the one position `pos` (a 0-dim tensor) of the history `hist` (b, n, d): the same
    features, read with index_select so that the shapes do not depend on the position."""
    q = hist.shape[-1] // 4
    img = pos - text_len - 1
    is_img = img >= 0
    left = torch.where(is_img & (img % fmap != 0), pos - 1, pos)
    above = torch.where(img >= fmap, pos - fmap, pos)
    cur = hist.index_select(1, pos.view(1))  # (b, 1, d)
    zero = torch.zeros_like(cur[..., :q])
    text_shift = torch.where(pos > 0, hist.index_select(1, (pos - 1).clamp(min=0).view(1))[..., :q], zero)
    left_feat = torch.where(left != pos, hist.index_select(1, left.view(1))[..., :q], zero)
    above_feat = torch.where(above != pos, hist.index_select(1, above.view(1))[..., q : 2 * q], zero)
    first = torch.where(is_img, left_feat, text_shift)
    second = torch.where(is_img, above_feat, cur[..., q : 2 * q])
    return torch.cat([first, second, cur[..., 2 * q :]], dim=-1)


class KVCache:
    """Static per-layer key/value buffers (b, h, n_max, d), and the input history token shift needs."""

    def __init__(
        self, batch: int, n_max: int, depth: int, heads: int, dim_head: int, dim: int, device, dtype, shift: bool
    ):
        shape = (batch, heads, n_max, dim_head)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(depth)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(depth)]
        hist = (batch, n_max, dim)
        self.attn_in = [torch.zeros(hist, device=device, dtype=dtype) for _ in range(depth)] if shift else None
        self.ff_in = [torch.zeros(hist, device=device, dtype=dtype) for _ in range(depth)] if shift else None


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int, dropout: float, qk_norm: bool):
        super().__init__()
        self.heads, self.dim_head = heads, dim_head
        self.to_qkv = nn.Linear(dim, 3 * heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim)
        self.dropout = dropout
        self.q_norm = nn.LayerNorm(dim_head) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(dim_head) if qk_norm else nn.Identity()

    def forward(self, x, mask, angles, is_full: bool, cache=None, layer: int = 0, start: int = 0):
        b, m, _ = x.shape
        q, k, v = self.to_qkv(x).view(b, m, 3, self.heads, self.dim_head).permute(2, 0, 3, 1, 4)  # (b, h, m, d)
        q, k = self.q_norm(q), self.k_norm(k)
        if torch.is_tensor(start):  # one position at a tensor index: shapes independent of the position
            return self._decode_at(q, k, v, mask, angles, cache, layer, start)
        if angles is not None:
            q, k = apply_rotary(q, angles[start : start + m]), apply_rotary(k, angles[start : start + m])
        if cache is not None:
            cache.k[layer][:, :, start : start + m] = k
            cache.v[layer][:, :, start : start + m] = v
            k, v = cache.k[layer][:, :, : start + m], cache.v[layer][:, :, : start + m]
        drop = self.dropout if self.training else 0.0
        if is_full and start == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)  # fused/flash path
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask[start : start + m, : start + m], dropout_p=drop
            )
        return self.to_out(out.transpose(1, 2).reshape(b, m, -1))

    def _decode_at(self, q, k, v, mask, angles, cache, layer: int, pos: torch.Tensor):
        """Decode step (gpt-fast style static cache): write the new key/value at `pos`, attend over the whole
        buffer with the mask row of `pos` (it hides every key after `pos`). One compiled graph serves all
        positions; eager, it is as fast as slicing the cache."""
        at = pos.view(1)
        if angles is not None:
            a = angles.index_select(0, at)
            q, k = apply_rotary(q, a), apply_rotary(k, a)
        cache.k[layer].index_copy_(2, at, k)
        cache.v[layer].index_copy_(2, at, v)
        out = F.scaled_dot_product_attention(q, cache.k[layer], cache.v[layer], attn_mask=mask.index_select(0, at))
        return self.to_out(out.transpose(1, 2).reshape(q.shape[0], 1, -1))


class FeedForward(nn.Module):
    """GEGLU feed-forward (as in the reference)."""

    def __init__(self, dim: int, mult: int, dropout: float):
        super().__init__()
        self.proj_in = nn.Linear(dim, dim * mult * 2)
        self.drop = nn.Dropout(dropout)
        self.proj_out = nn.Linear(dim * mult, dim)

    def forward(self, x):
        a, gate = self.proj_in(x).chunk(2, dim=-1)
        return self.proj_out(self.drop(a * F.gelu(gate)))


class Block(nn.Module):
    def __init__(self, cfg, attn_type: str, layer_index: int):
        super().__init__()
        dim = cfg.dim
        self.attn_type = attn_type
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, cfg.heads, cfg.dim_head, cfg.attn_dropout, cfg.qk_norm)
        self.ff = FeedForward(dim, cfg.ff_mult, cfg.ff_dropout)
        # sandwich norm (CogView): normalize each branch's output too
        self.post1 = nn.LayerNorm(dim) if cfg.sandwich_norm else nn.Identity()
        self.post2 = nn.LayerNorm(dim) if cfg.sandwich_norm else nn.Identity()
        # LayerScale (CaiT), part of `stable`: small residual branches early in training
        init = 0.1 if layer_index < 18 else 1e-5
        self.scale1 = nn.Parameter(torch.full((dim,), init)) if cfg.stable else None
        self.scale2 = nn.Parameter(torch.full((dim,), init)) if cfg.stable else None
        self.shift = cfg.shift_tokens
        self.text_len, self.fmap = cfg.text_seq_len, cfg.image_fmap_size

    def _shifted(self, h, hist, start):
        if not self.shift:
            return h
        if hist is None:
            return shift_tokens(h, self.text_len, self.fmap)
        if torch.is_tensor(start):
            hist.index_copy_(1, start.view(1), h)
            return shift_token_at(hist, start, self.text_len, self.fmap)
        m = h.shape[1]
        hist[:, start : start + m] = h
        return shift_tokens(hist[:, : start + m], self.text_len, self.fmap, start=start)

    def forward(self, x, mask, angles, cache=None, layer=0, start=0):
        h = self._shifted(self.norm1(x), cache.attn_in[layer] if cache and cache.attn_in else None, start)
        h = self.post1(self.attn(h, mask, angles, self.attn_type == "full", cache, layer, start))
        x = x + (h * self.scale1 if self.scale1 is not None else h)
        h = self._shifted(self.norm2(x), cache.ff_in[layer] if cache and cache.ff_in else None, start)
        h = self.post2(self.ff(h))
        return x + (h * self.scale2 if self.scale2 is not None else h)


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        types = [cfg.attn_types[i % len(cfg.attn_types)] for i in range(cfg.depth)]
        self.layers = nn.ModuleList(Block(cfg, t, i) for i, t in enumerate(types))
        for t in set(types):
            self.register_buffer(
                f"mask_{t}", attention_mask(t, cfg.text_seq_len, cfg.image_fmap_size), persistent=False
            )
        angles = rotary_angles(cfg.text_seq_len, cfg.image_fmap_size, cfg.dim_head) if cfg.rotary_emb else None
        self.register_buffer("angles", angles, persistent=False)

    def forward(self, x, cache: KVCache | None = None, start: int = 0):
        for i, layer in enumerate(self.layers):
            x = layer(x, getattr(self, f"mask_{layer.attn_type}"), self.angles, cache, i, start)
        return x
