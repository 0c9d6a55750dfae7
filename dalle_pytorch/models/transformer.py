"""The decoder-only transformer under DALLE: pre-norm blocks, SDPA attention (sparse patterns computed sparsely),
rotary positions, token shift, the stabilizers users know (CogView's, sandwich norm, QK-norm), and Llama's parts
(RMSNorm, SwiGLU, grouped-query attention: layers.py and --kv_heads).

The sequence is [<bos>, text (text_seq_len), image (fmap^2)] minus its last token, or with LlamaGen's layout
[caption (text_seq_len), image (fmap^2)] minus its last token: the functions below take `text_len`, the prefix
before the first image token less one (text_seq_len with a bos, text_seq_len - 1 without). Masks are built once
per attention type from the layout; the KV cache lets generation decode one token per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import flex
from .layers import feed_forward, norm_layer
from .sparse_attention import SparseLayout, sparse_attention

ATTN_TYPES = ("full", "axial_row", "axial_col", "conv_like", "sparse")


def attention_mask(kind: str, text_len: int, fmap: int, kernel: int = 5) -> torch.Tensor:
    """(n, n) bool, True where query i may attend key j; n = text_len + fmap**2 (bos + text + image - 1).

    Positions 0..text_len hold bos and text; position text_len + 1 + k holds image token k. The query at
    position q >= text_len predicts image token t = q - text_len; sparse patterns keep the image keys that
    share its row (axial_row), its column (axial_col) or a kernel window around it (conv_like); `sparse`
    is the Sparse Transformer's strided pattern (Child et al. 2019) at stride = image width: the previous
    `fmap` image tokens and every earlier token of its column. Every query sees all text and itself, and
    nothing after itself.
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
    elif kind == "sparse":
        same = (tc[:, None] == kc[None, :]) | (key_img[None, :] >= target[:, None] - fmap)
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


def llamagen_rotary(caption_len: int, fmap: int, dim_head: int, theta: float = 10000.0) -> torch.Tensor:
    """LlamaGen's 2-D rotary table (n, dim_head // 2, 2) of (cos, sin) for [caption, image - 1]: every feature pair
    (adjacent features) rotates, the first half of the pairs by the image row and the second by the column, with
    Llama's frequencies over dim_head // 2; the caption positions' entries are zero, as LlamaGen builds them (its
    captions' queries and keys are zero vectors: they attend uniformly and are attended to with score 0). Image
    token k sits at position caption_len + k with the row and column of token k."""
    half = dim_head // 2
    freqs = 1.0 / theta ** (torch.arange(0, half, 2)[: half // 2].float() / half)
    grid = torch.outer(torch.arange(fmap).float(), freqs)  # (fmap, dim_head // 4)
    rows = grid[:, None, :].expand(-1, fmap, -1)
    cols = grid[None, :, :].expand(fmap, -1, -1)
    angles = torch.cat([rows, cols], dim=-1).flatten(0, 1)  # (fmap^2, dim_head // 2)
    table = torch.stack([angles.cos(), angles.sin()], dim=-1)
    return torch.cat([torch.zeros(caption_len, half, 2), table[: fmap * fmap - 1]])


def apply_rotary(x: torch.Tensor, angles: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """Rotate the first 2*angles.shape[-1] features of x (b, h, n, d) by `angles` (n, r); or (`pairs`), with
    LlamaGen's table (n, d // 2, 2) of cos and sin, every adjacent pair of features, in float32 as LlamaGen does.
    `angles` may carry leading dims that broadcast against x's (b, h)."""
    if pairs:
        pairs = x.float().unflatten(-1, (-1, 2))
        cos, sin = angles[..., 0], angles[..., 1]
        x0, x1 = pairs[..., 0], pairs[..., 1]
        return torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1).flatten(-2).to(x.dtype)
    r = angles.shape[-1]
    rot, rest = x[..., : 2 * r], x[..., 2 * r :]
    x1, x2 = rot[..., :r], rot[..., r:]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)


def shift_tokens(x: torch.Tensor, pos: torch.Tensor, text_len: int, fmap: int, reference: bool = False) -> torch.Tensor:
    """Token shift (after lucidrains' DALLE-pytorch, itself after RWKV) at the positions `pos` (m,) of the
    sequence x (b, n, d): (b, m, d). Text: the first quarter of the features comes from the previous token.
    Image: the first quarter from the token to the left, the second from the token above (zeros past the
    image's edges). Neighbours are gathered by index, so the whole sequence (pos = arange(n)) and one decode
    position (pos of length 1, x the cached history) share this code and no shape depends on the position.

    `reference`: lucidrains' dalle-pytorch 1.6 (PreShiftToken): text takes the first half from the previous
    token; image the first quarter from above and the second from the left."""
    q = x.shape[-1] // 4
    img = pos - text_len - 1  # image index held at each position (negative for bos and text)
    is_img = img >= 0
    # an image token's neighbours; -1 where one is missing (past an image edge; before bos for pos - 1)
    above = torch.where(img >= fmap, pos - fmap, -1)
    left = torch.where(img % fmap == 0, -1, pos - 1)

    def take(src: torch.Tensor, lo: int, hi: int) -> torch.Tensor:  # features lo:hi of the rows src (b, m, hi - lo)
        # indexing, not index_select: index_select on a feature slice (non-contiguous) is ~10x slower on CPU
        return x[:, src.clamp(min=0), lo:hi].masked_fill((src < 0)[None, :, None], 0.0)

    if not reference:
        first = torch.where(is_img, left, pos - 1)  # text: the previous token
        second = torch.where(is_img, above, pos)  # text: itself
        return torch.cat([take(first, 0, q), take(second, q, 2 * q), x[:, pos, 2 * q :]], dim=-1)
    h = x.shape[-1] // 2
    text = torch.cat([take(pos - 1, 0, h), x[:, pos, h:]], dim=-1)
    image = torch.cat([take(above, 0, q), take(left, q, 2 * q), x[:, pos, 2 * q :]], dim=-1)
    return torch.where(is_img[None, :, None], image, text)


@dataclass
class LayerCache:
    """One layer's static buffers: keys and values (b, h, n_max, d_head), and, with token shift, the inputs
    of the attention and feed-forward branches (b, n_max, dim) whose neighbours the shift reads."""

    k: torch.Tensor
    v: torch.Tensor
    attn_in: torch.Tensor | None
    ff_in: torch.Tensor | None


class KVCache:
    """Static per-layer buffers for the whole sequence (gpt-fast style): decoding writes one row at a time.
    `heads` is the number of key/value heads: grouped-query attention (--kv_heads) shrinks the cache with it."""

    def __init__(
        self, batch: int, n_max: int, depth: int, heads: int, dim_head: int, dim: int, device, dtype, shift: bool
    ):
        def zeros(*shape):
            return torch.zeros(shape, device=device, dtype=dtype)

        # (b, n_max) which keys may be read at all: set by a prefill whose caption has padding (None: every key)
        self.keys: torch.Tensor | None = None
        self.layers = [
            LayerCache(
                k=zeros(batch, heads, n_max, dim_head),
                v=zeros(batch, heads, n_max, dim_head),
                attn_in=zeros(batch, n_max, dim) if shift else None,
                ff_in=zeros(batch, n_max, dim) if shift else None,
            )
            for _ in range(depth)
        ]


class Attention(nn.Module):
    def __init__(
        self,
        dim: int,
        heads: int,
        dim_head: int,
        dropout: float,
        qk_norm: bool,
        causal_only: bool,
        kv_heads: int = 0,
        norm: str = "layernorm",
        pairs: bool = False,
    ):
        """`kv_heads` < `heads`: grouped-query attention (Ainslie et al. 2023), each key/value head serving
        heads // kv_heads query heads; 0 means one per query head. With kv_heads == heads the projection's
        layout is the one every earlier export has: [q | k | v], each heads * dim_head wide."""
        super().__init__()
        self.heads, self.dim_head = heads, dim_head
        self.kv_heads = kv_heads or heads
        self.causal_only = causal_only  # the mask is plain causal: SDPA's fused is_causal path serves it
        self.pairs = pairs  # LlamaGen's rotary table (llamagen_rotary) rather than rotary_angles
        self.to_qkv = nn.Linear(dim, (heads + 2 * self.kv_heads) * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim)
        self.dropout = dropout
        self.q_norm = norm_layer(norm, dim_head) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(norm, dim_head) if qk_norm else nn.Identity()

    def _qkv(self, x: torch.Tensor, angles: torch.Tensor | None):
        d = self.dim_head
        q, k, v = self.to_qkv(x).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q = rearrange(q, "b m (h d) -> b h m d", d=d)
        k, v = (rearrange(t, "b m (h d) -> b h m d", d=d) for t in (k, v))  # (b, kv_heads, m, d)
        q, k = self.q_norm(q), self.k_norm(k)
        if angles is not None:
            q, k = apply_rotary(q, angles, self.pairs), apply_rotary(k, angles, self.pairs)
        return q, k, v

    def _grouped(self, t: torch.Tensor) -> torch.Tensor:
        """(b, kv_heads, n, d) -> (b, heads, n, d) for the kernels without a grouped-query mode (the sparse
        pieces, flex); SDPA reads the grouped keys directly (enable_gqa)."""
        return t if self.kv_heads == self.heads else t.repeat_interleave(self.heads // self.kv_heads, dim=1)

    def _out(self, out: torch.Tensor) -> torch.Tensor:
        return self.to_out(rearrange(out, "b h m d -> b m (h d)"))

    def forward(self, x, mask, angles, cache: LayerCache | None = None, layout: SparseLayout | None = None):
        """Positions 0..m-1 of x (b, m, dim); with a cache, their keys and values are stored for decoding.
        `layout`: the pattern's sparse layout, used when x is the whole sequence."""
        m = x.shape[1]
        q, k, v = self._qkv(x, None if angles is None else angles[:m])
        if cache is not None:
            cache.k[:, :, :m] = k
            cache.v[:, :, :m] = v
        drop = self.dropout if self.training else 0.0
        gqa = self.kv_heads != self.heads
        if mask.dim() == 4:  # (b, 1, n, n): the pattern and each row's caption padding (Transformer.forward)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[..., :m, :m], dropout_p=drop, enable_gqa=gqa)
        elif self.causal_only:  # fused/flash path
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop, enable_gqa=gqa)
        elif layout is not None and m == mask.shape[0]:
            out = sparse_attention(q, self._grouped(k), self._grouped(v), layout, drop)  # the scores kept only
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:m, :m], dropout_p=drop, enable_gqa=gqa)
        return self._out(out)

    def decode(self, x, mask, angles, cache: LayerCache, pos: torch.Tensor, layout=None, keys=None):
        """The one position `pos` (0-dim tensor) of x (b, 1, dim): write its key and value at `pos`, attend
        over the whole static buffer with mask row `pos`, which hides every key after it. No shape depends
        on the position, so one compiled graph serves every step (gpt-fast's decode). A sparse pattern on
        CUDA reads only the key tiles of that row (FlexAttention)."""
        at = pos.view(1)
        q, k, v = self._qkv(x, None if angles is None else angles.index_select(0, at))
        cache.k.index_copy_(2, at, k)
        cache.v.index_copy_(2, at, v)
        if layout is not None and keys is None and flex.serves(q, layout.flex):
            return self._out(flex.attend(q, self._grouped(cache.k), self._grouped(cache.v), layout.flex, pos))
        gqa = self.kv_heads != self.heads
        row = mask.index_select(0, at)  # (1, n)
        if keys is not None:  # (b, n): the caption's padding stays unread
            row = row & keys[:, None, None, :]
        return self._out(F.scaled_dot_product_attention(q, cache.k, cache.v, attn_mask=row, enable_gqa=gqa))

    def window(self, x, rows, angles, cache: LayerCache, pos: torch.Tensor):
        """Positions `pos` (b, w) of x (b, w, dim), each row its own (speculative decoding: rows accept different
        lengths): their keys and values written there, attention over the whole static buffer with `rows`
        (b, 1, w, n_max) as the mask. `angles`: the rotary entries of `pos`, (b, 1, w, ...), or None."""
        q, k, v = self._qkv(x, angles)
        at = pos[:, None, :, None]
        cache.k.scatter_(2, at.expand(-1, k.shape[1], -1, k.shape[-1]), k)
        cache.v.scatter_(2, at.expand(-1, v.shape[1], -1, v.shape[-1]), v)
        gqa = self.kv_heads != self.heads
        return self._out(F.scaled_dot_product_attention(q, cache.k, cache.v, attn_mask=rows, enable_gqa=gqa))


class Block(nn.Module):
    def __init__(self, cfg, attn_type: str, layer_index: int, attn: Attention | None = None, ff=None):
        """`attn`, `ff`: modules of an earlier block to share (--shared_attn_ids, --shared_ff_ids)."""
        super().__init__()
        dim = cfg.dim
        self.attn_type = attn_type
        self.norm1, self.norm2 = norm_layer(cfg.norm, dim), norm_layer(cfg.norm, dim)
        full = attn_type == "full"
        self.attn = attn or Attention(
            dim,
            cfg.heads,
            cfg.dim_head,
            cfg.attn_dropout,
            cfg.qk_norm,
            full,
            cfg.kv_heads,
            cfg.norm,
            cfg.llamagen_layout,
        )
        self.ff = ff or feed_forward(cfg)
        # sandwich norm (CogView): normalize each branch's output too
        self.post1 = norm_layer(cfg.norm, dim) if cfg.sandwich_norm else nn.Identity()
        self.post2 = norm_layer(cfg.norm, dim) if cfg.sandwich_norm else nn.Identity()
        # LayerScale (CaiT), part of `stable`: small residual branches early in training
        init = 0.1 if layer_index < 18 else 1e-5
        self.scale1 = nn.Parameter(torch.full((dim,), init)) if cfg.stable else None
        self.scale2 = nn.Parameter(torch.full((dim,), init)) if cfg.stable else None
        self.shift = cfg.shift_tokens
        self.reference_shift = cfg.reference_layout
        self.text_len, self.fmap = cfg.prefix_len - 1, cfg.image_fmap_size

    def forward(self, x, mask, angles, cache: LayerCache | None = None, layout: SparseLayout | None = None):
        """Positions 0..m-1 (training, logits, prefill); fills the cache's rows 0..m-1 when given one."""
        pos = torch.arange(x.shape[1], device=x.device)
        return self._residuals(x, pos, cache, lambda h: self.attn(h, mask, angles, cache, layout))

    def decode(self, x, mask, angles, cache: LayerCache, pos: torch.Tensor, layout=None, keys=None):
        """The one position `pos` (0-dim tensor) of x (b, 1, dim), reading and extending the cache."""
        attend = lambda h: self.attn.decode(h, mask, angles, cache, pos, layout, keys)  # noqa: E731
        return self._residuals(x, pos.view(1), cache, attend)

    def window(self, x, rows, angles, cache: LayerCache, pos: torch.Tensor):
        """Positions `pos` (b, w), per row, of x (b, w, dim) (Attention.window); no token shift."""
        return self._residuals(x, None, None, lambda h: self.attn.window(h, rows, angles, cache, pos))

    def _residuals(self, x, pos, cache: LayerCache | None, attend):
        h = self.post1(attend(self._shifted(self.norm1(x), pos, None if cache is None else cache.attn_in)))
        x = x + (h * self.scale1 if self.scale1 is not None else h)
        h = self.post2(self.ff(self._shifted(self.norm2(x), pos, None if cache is None else cache.ff_in)))
        return x + (h * self.scale2 if self.scale2 is not None else h)

    def _shifted(self, h, pos, history: torch.Tensor | None):
        """Token shift of h (b, m, d) at positions pos (m,); with a cache, h is first written into the
        history the shift reads its neighbours from."""
        if not self.shift:
            return h
        seq = h if history is None else history.index_copy_(1, pos, h)
        return shift_tokens(seq, pos, self.text_len, self.fmap, self.reference_shift)


def _blocks(cfg, types: list[str]) -> list[Block]:
    """One block per layer; layers with the same id in cfg.shared_attn_ids (cfg.shared_ff_ids), cycled over
    the depth, share one attention (feed-forward) module, as lucidrains' DALLE-pytorch did. Their norms stay
    their own."""

    def ids(given: list) -> list:
        return [given[i % len(given)] for i in range(cfg.depth)] if given else list(range(cfg.depth))

    attn_ids, ff_ids = ids(cfg.shared_attn_ids), ids(cfg.shared_ff_ids)
    attns: dict = {}
    ffs: dict = {}
    blocks = []
    for i, t in enumerate(types):
        shared = attns.get(attn_ids[i])
        if shared is not None and shared[1] != t:
            raise ValueError(
                f"--shared_attn_ids: layer {i} ({t}) would share the attention of a {shared[1]} layer: "
                "give layers of different --attn_types different ids"
            )
        block = Block(cfg, t, i, None if shared is None else shared[0], ffs.get(ff_ids[i]))
        attns.setdefault(attn_ids[i], (block.attn, t))
        ffs.setdefault(ff_ids[i], block.ff)
        blocks.append(block)
    return blocks


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        types = [cfg.attn_types[i % len(cfg.attn_types)] for i in range(cfg.depth)]
        self.layers = nn.ModuleList(_blocks(cfg, types))
        # each sparse pattern's score layout, computed from its mask (the mask serves prefixes and decoding)
        self.layouts = nn.ModuleDict()
        text_len, fmap = cfg.prefix_len - 1, cfg.image_fmap_size
        for t in sorted(set(types)):
            mask = attention_mask(t, text_len, fmap)
            self.register_buffer(f"mask_{t}", mask, persistent=False)
            if t != "full":
                self.layouts[t] = SparseLayout(t, mask, text_len, fmap)
        angles = None
        if cfg.llamagen_layout:
            angles = llamagen_rotary(cfg.text_seq_len, fmap, cfg.dim_head)
        elif cfg.rotary_emb:
            angles = rotary_angles(text_len, fmap, cfg.dim_head)
        self.register_buffer("angles", angles, persistent=False)
        # recompute each block in backward instead of keeping its activations (set by --checkpoint_activations)
        self.checkpoint_activations = False

    def _mask(self, layer: Block) -> torch.Tensor:
        return getattr(self, f"mask_{layer.attn_type}")

    def _layout(self, layer: Block) -> SparseLayout | None:
        return self.layouts[layer.attn_type] if layer.attn_type in self.layouts else None

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, keys: torch.Tensor | None = None) -> torch.Tensor:
        """x (b, m, dim) at positions 0..m-1 -> (b, m, dim); fills the cache's rows 0..m-1 when given one.
        keys (b, k <= m): which of the first k positions may be attended to (a caption's padding may not, except by
        itself, as LlamaGen's mask has it: a row with no other key reads its own); the attention then takes a
        per-row mask instead of its pattern's fused or sparse path."""
        recompute = self.checkpoint_activations and cache is None and torch.is_grad_enabled()
        m = x.shape[1]
        if keys is not None:
            keys = torch.cat([keys, keys.new_ones(keys.shape[0], m - keys.shape[1])], dim=1)  # (b, m)
            if cache is not None:
                n_max = cache.layers[0].k.shape[2]
                cache.keys = torch.cat([keys, keys.new_ones(keys.shape[0], n_max - m)], dim=1)
        for i, layer in enumerate(self.layers):
            mask, layout = self._mask(layer), self._layout(layer)
            if keys is not None:
                eye = torch.eye(m, dtype=torch.bool, device=x.device)
                mask, layout = (mask[:m, :m] & keys[:, None, None, :]) | eye, None  # (b, 1, m, m)
            if recompute:  # only the block's input is kept; non-reentrant, so it nests in DDP, FSDP, ZeRO-3, compile
                x = checkpoint(layer, x, mask, self.angles, None, layout, use_reentrant=False)
            else:
                x = layer(x, mask, self.angles, None if cache is None else cache.layers[i], layout)
        return x

    def window(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """x (b, w, dim) at positions `pos` (b, w), each row its own, -> (b, w, dim), attending over the cache and
        writing these positions' keys and values into it (speculative decoding, models/sjd.py). Positions past the
        sequence land in the cache's spare rows (KVCache extra) and their outputs mean nothing. The pattern's mask
        rows apply densely (no sparse kernel); token shift is not supported (it reads one position's neighbours)."""
        n = self._mask(self.layers[0]).shape[0]
        n_max = cache.layers[0].k.shape[2]
        inside = pos.clamp(max=n - 1)
        angles = None if self.angles is None else self.angles[inside][:, None]  # (b, 1, w, ...)
        masks = {}  # each pattern's rows, gathered once for its layers
        for layer, layer_cache in zip(self.layers, cache.layers):
            if layer.attn_type not in masks:
                rows = self._mask(layer)[inside]  # (b, w, n): what each row's position may read
                rows = F.pad(rows, (0, n_max - n))  # the spare rows are never read
                if cache.keys is not None:
                    rows = rows & cache.keys[:, None, :]
                masks[layer.attn_type] = rows[:, None]
            x = layer.window(x, masks[layer.attn_type], angles, layer_cache, pos)
        return x

    def decode(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """x (b, 1, dim) at position `pos` (0-dim tensor) -> (b, 1, dim), attending over the cache."""
        for layer, layer_cache in zip(self.layers, cache.layers):
            x = layer.decode(x, self._mask(layer), self.angles, layer_cache, pos, self._layout(layer), cache.keys)
        return x
