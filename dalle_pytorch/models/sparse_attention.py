"""The sparse attention patterns computed sparsely: only the scores a pattern keeps are computed.

Every pattern of DALL-E's (Ramesh et al. 2021, appendix B.1, figure 11) lets each image query see all
the text, itself, and a few image keys chosen by the image grid: its row, its column, a window around it.
So the scores of an image query are three dense pieces and no masked block is ever computed:
- text: one (image queries x text keys) matmul;
- self: the query's own key, one dot product per query;
- parts: the queries are grouped (by image row, or by column) and each group attends to the few image
  keys its members may see, gathered into a (group x keys) block: a batched matmul of small blocks.
One softmax runs over the pieces: on the CPU the text and each part are one call of SDPA's fused flash
kernel, the self scores a dot product, and the pieces merge by their log-sum-exps (_FlashPieces); elsewhere
the scores sit side by side in plain ops.
The text queries attend causally over the text.

`SparseLayout` is built once per pattern from the dense boolean mask itself, and checks that its pieces
cover exactly the mask's True entries, so this path computes the same function as SDPA with the mask
(tests/models/test_sparse_attention.py compares outputs and gradients). It serves a whole sequence; a shorter
prefix (generation's prefill of a partial sequence) and one-token decoding use the dense mask, except on
CUDA, where FlexAttention serves the whole sequence and the decoding (flex.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from . import flex

# how each pattern's image keys split into parts: (query grouping, which allowed image keys the part holds).
# Half-row groups (16 queries) keep conv_like's gathered windows small: 3 rows x 20 columns instead of 3 x 32.
PARTS = {
    "axial_row": [("rows", None)],
    "axial_col": [("cols", None)],
    "conv_like": [(16, None)],
    # the Sparse Transformer's strided pattern at stride = image width: the previous row's worth of tokens
    # (grouped by row), then the rest of the column (grouped by column)
    "sparse": [("rows", "window"), ("cols", None)],
}


def _groups(kind, fmap: int) -> torch.Tensor:
    """(groups, group size) image-query indices: image rows, image columns, or runs of `kind` queries in a row."""
    grid = torch.arange(fmap * fmap).view(fmap, fmap)
    if kind == "rows":
        return grid
    if kind == "cols":
        return grid.t().contiguous()
    size = kind if fmap % kind == 0 else fmap
    return grid.reshape(-1, size)


class SparseLayout(nn.Module):
    """Index buffers of one pattern over the sequence [bos + text (text_len), image (fmap^2) - 1]; query
    position text_len + t is image query t (it predicts image token t), key position text_len + 1 + k holds
    image token k. Buffers, so they follow the model to its device."""

    def __init__(self, kind: str, mask: torch.Tensor, text_len: int, fmap: int):
        super().__init__()
        n = mask.shape[0]
        t0, ni = text_len, fmap * fmap
        img = mask[t0:]  # (ni, n): the image queries' rows
        self.text_len, self.num_parts = text_len, len(PARTS[kind])
        # keys each piece holds; every piece removes what an earlier piece already holds, so none counts twice
        left = img.clone()
        left[:, : t0 + 1] = False  # the text piece: every text key (positions 0..text_len)
        assert img[:, : t0 + 1].all(), "every image query sees all text"
        query_pos = torch.arange(t0, n)
        self_ok = left[torch.arange(ni), query_pos]  # the self piece (query t=0's own key is a text key)
        left[torch.arange(ni), query_pos] = False
        self.register_buffer("self_ok", self_ok, persistent=False)
        self.register_buffer("text_causal", mask[:t0, :t0].clone(), persistent=False)
        for i, (grouping, only) in enumerate(PARTS[kind]):
            holds = left.clone()
            if only == "window":  # keys within one image row's worth of tokens before the query
                key_img = torch.arange(n) - t0 - 1
                holds &= key_img[None, :] >= torch.arange(ni)[:, None] - fmap
            left &= ~holds
            queries = _groups(grouping, fmap)  # (g, s)
            members = holds[queries]  # (g, s, n): which keys each member may see
            used = members.any(1)  # (g, n): the keys the group gathers
            w = max(int(used.sum(1).max()), 1)
            # each group's keys first, in sequence order (a stable sort), then unused keys as padding (masked out)
            keys = torch.sort((~used).int(), dim=1, stable=True).indices[:, :w]  # (g, w)
            allowed = torch.gather(members, 2, keys[:, None, :].expand(-1, queries.shape[1], -1))  # (g, s, w)
            allowed &= torch.gather(used, 1, keys)[:, None, :]
            order = queries.flatten()
            identity = bool((order == torch.arange(ni)).all())
            self.register_buffer(f"queries{i}", None if identity else order, persistent=False)
            self.register_buffer(f"inverse{i}", None if identity else torch.argsort(order), persistent=False)
            self.register_buffer(f"keys{i}", keys, persistent=False)
            self.register_buffer(f"allowed{i}", allowed, persistent=False)
        assert not left.any(), f"{kind}: the pattern's parts miss some of the mask's keys"
        kept = (t0 + 1) * ni + int(self_ok.sum()) + sum(int(self.part(i)[3].sum()) for i in range(self.num_parts))
        assert kept == int(img.sum()), f"{kind}: the pieces hold {kept} scores, the mask {int(img.sum())}"
        computed = (t0 + 1 + 1) * ni + sum(self.part(i)[3].numel() for i in range(self.num_parts))
        # the fraction of the n x n score matrix this path computes (text queries: causal over the text)
        self.computed_fraction = (computed + t0 * (t0 + 1) / 2) / (n * n)
        self.flex = flex.FlexLayout(mask) if flex.available() else None  # the pattern's tiles, for CUDA

    def part(self, i: int):
        """(queries or None for identity order, inverse order, keys (g, w), allowed (g, s, w)) of part i."""
        return (getattr(self, f"queries{i}"), getattr(self, f"inverse{i}"), getattr(self, f"keys{i}"),
                getattr(self, f"allowed{i}"))  # fmt: skip


def sparse_attention(q, k, v, layout: SparseLayout, dropout: float = 0.0) -> torch.Tensor:
    """q, k, v (b, h, n, d) over the whole sequence -> (b, h, n, d), equal to SDPA with the pattern's mask.

    On CUDA, FlexAttention over the pattern's tiles (flex.py); on the CPU each piece runs in SDPA's fused flash
    kernel and the pieces merge by their log-sum-exps; elsewhere (and with attention dropout, which neither
    kernel has) they are plain batched matmuls."""
    if flex.serves(q, layout.flex, dropout):
        return flex.attend(q, k, v, layout.flex)
    if _fused_cpu(q, k, v) and not dropout:
        return _FlashPieces.apply(q, k, v, layout)
    return _sparse_attention_ops(q, k, v, layout, dropout)


def _sparse_attention_ops(q, k, v, layout: SparseLayout, dropout: float = 0.0) -> torch.Tensor:
    """sparse_attention as plain ops, on any device: one softmax over the pieces' scores side by side."""
    b, h, n, d = q.shape
    t0 = layout.text_len
    # the text queries: causal attention over the text, in two plain matmuls
    qt = (q[:, :, :t0] * d**-0.5).reshape(b * h, t0, d)
    # (b * h, ., d) and contiguous: batched matmuls over strided 4-D views fall back to one copy per matrix
    qi = (q[:, :, t0:] * d**-0.5).reshape(b * h, -1, d)  # the image queries, scaled once
    k, v = k.reshape(b * h, n, d), v.reshape(b * h, n, d)
    ni = qi.shape[1]
    k_self, v_self = k[:, t0:], v[:, t0:]  # each image query's own key and value
    k_text, v_text = k[:, : t0 + 1], v[:, : t0 + 1]  # bos + text
    # -inf, not a dtype's minimum: under autocast the scores' dtype need not be q's (fp32 after --qk_norm's
    # LayerNorm, fp16 out of bmm); no softmax row is all masked, as every row sees the text or itself
    neg = float("-inf")
    st = torch.bmm(qt, k[:, :t0].transpose(1, 2)).masked_fill(~layout.text_causal, neg)
    pt = st.softmax(-1, dtype=torch.promote_types(qt.dtype, torch.float32)).to(v.dtype)
    out_text = torch.bmm(F.dropout(pt, dropout) if dropout else pt, v[:, :t0]).view(b, h, t0, d)
    self_score = (qi * k_self).sum(-1, keepdim=True).masked_fill(~layout.self_ok[:, None], neg)
    scores, widths = [torch.bmm(qi, k_text.transpose(1, 2)), self_score], [t0 + 1, 1]
    for i in range(layout.num_parts):
        queries, inverse, keys, allowed = layout.part(i)
        g, s, w = allowed.shape
        qp = (qi if queries is None else qi.index_select(1, queries)).reshape(b * h * g, s, d)
        kp = k.index_select(1, keys.flatten()).view(b * h * g, w, d)
        sp = torch.bmm(qp, kp.transpose(1, 2)).view(b * h, g, s, w).masked_fill(~allowed, neg).view(b * h, ni, w)
        scores.append(sp if inverse is None else sp.index_select(1, inverse))  # back in query order
        widths.append(w)
    # (b * h, ni, text + 1 + parts); the softmax in at least fp32, as SDPA's kernels do
    p = torch.cat(scores, -1).softmax(-1, dtype=torch.promote_types(qi.dtype, torch.float32)).to(v.dtype)
    p = F.dropout(p, dropout) if dropout else p
    p_text, p_self, *p_parts = p.split(widths, -1)
    out = torch.baddbmm(p_self * v_self, p_text, v_text)
    for i, pp in enumerate(p_parts):
        queries, inverse, keys, allowed = layout.part(i)
        g, s, w = allowed.shape
        pp = (pp if queries is None else pp.index_select(1, queries)).reshape(b * h * g, s, w)
        vp = v.index_select(1, keys.flatten()).view(b * h * g, w, d)
        op = torch.bmm(pp, vp).view(b * h, ni, d)
        out = out + (op if inverse is None else op.index_select(1, inverse))
    return torch.cat([out_text, out.view(b, h, ni, d)], 2)


# The CPU flash kernel's forward returns each row's log-sum-exp, and its backward takes the output and the
# log-sum-exp to differentiate against: given the merged ones, each piece's backward is exactly its share
# of the whole softmax's gradient (the split-KV merge of ring attention and flash-decoding).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _fused_cpu(q, k, v) -> bool:
    """Whether the CPU flash kernel can serve: one dtype, and packed last dimensions (the raw op does not
    check them, SDPA does before choosing it)."""
    same = q.dtype == k.dtype == v.dtype and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    return _FLASH_CPU is not None and q.device.type == "cpu" and same


def _part_inputs(layout: SparseLayout, i: int, x, k, v):
    """Part i's queries (or any per-query tensor x (b, h, ni, .)) grouped, and its gathered keys and values:
    (b * h * ... as (b*h, g, s, .), (b*h, g, w, d), (b*h, g, w, d)), and the float mask (1, g, s, w)."""
    queries, _, keys, allowed = layout.part(i)
    b, h, _, d = k.shape
    g, s, w = allowed.shape
    group = lambda t: (t if queries is None else t.index_select(2, queries)).reshape(b * h, g, s, -1)  # noqa: E731
    kp = k.index_select(2, keys.flatten()).view(b * h, g, w, d)
    vp = v.index_select(2, keys.flatten()).view(b * h, g, w, d)
    bias = torch.zeros(allowed.shape, dtype=k.dtype, device=k.device).masked_fill(~allowed, float("-inf"))
    return group, kp, vp, bias[None]


def _self_scores(qi, k_self, layout: SparseLayout, scale: float) -> torch.Tensor:
    acc = torch.promote_types(qi.dtype, torch.float32)  # as the kernel's scores for the other pieces
    return ((qi.to(acc) * k_self.to(acc)).sum(-1) * scale).masked_fill(~layout.self_ok, float("-inf"))  # (b, h, ni)


class _FlashPieces(torch.autograd.Function):
    """sparse_attention with every piece in the CPU flash kernel: the text queries causal over the text;
    each image query over the text, itself, and its parts, merged by log-sum-exp. Saves q, k, v, the output
    and the log-sum-exps (no probabilities); the gathers are redone in backward."""

    @staticmethod
    def forward(ctx, q, k, v, layout: SparseLayout):
        b, h, n, d = q.shape
        t0, scale = layout.text_len, d**-0.5
        qi = q[:, :, t0:]
        out_text, lse_text = _FLASH_CPU(q[:, :, :t0], k[:, :, :t0], v[:, :, :t0], is_causal=True, scale=scale)
        o, lse = _FLASH_CPU(qi, k[:, :, : t0 + 1], v[:, :, : t0 + 1], scale=scale)
        outs, lses = [o, v[:, :, t0:]], [lse, _self_scores(qi, k[:, :, t0:], layout, scale)]
        for i in range(layout.num_parts):
            _, inverse, _, allowed = layout.part(i)
            group, kp, vp, bias = _part_inputs(layout, i, qi, k, v)
            o, lse = _FLASH_CPU(group(qi), kp, vp, attn_mask=bias, scale=scale)
            lse = lse.masked_fill(~allowed.any(-1), float("-inf"))  # the kernel gives a row without keys lse 0
            o, lse = o.reshape(b, h, -1, d), lse.reshape(b, h, -1)
            outs.append(o if inverse is None else o.index_select(2, inverse))
            lses.append(lse if inverse is None else lse.index_select(2, inverse))
        lse_image = torch.logsumexp(torch.stack(lses), 0)  # (b, h, ni): the whole row's
        acc = lse_image.dtype  # at least fp32: the merge is a softmax's normalization
        out_image = outs[0].to(acc) * (lses[0] - lse_image).exp()[..., None]
        for o, lse in zip(outs[1:], lses[1:]):
            out_image = out_image.addcmul_(o.to(acc), (lse - lse_image).exp()[..., None])
        # in q's memory order, as SDPA's output: the (b, h, n, d) -> (b, n, h * d) reshape after it is a view
        out = torch.empty_like(q)
        out[:, :, :t0], out[:, :, t0:] = out_text, out_image
        ctx.layout = layout
        ctx.save_for_backward(q, k, v, out, lse_text, lse_image)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse_text, lse_image = ctx.saved_tensors
        layout = ctx.layout
        t0, scale = layout.text_len, q.shape[-1] ** -0.5
        dout = dout.contiguous()
        # the pieces' gradients summed in at least fp32, rounded to the inputs' dtype once
        acc = lse_image.dtype
        dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
        qi, di, oi = q[:, :, t0:], dout[:, :, t0:], out[:, :, t0:]
        dq[:, :, :t0], dk[:, :, :t0], dv[:, :, :t0] = _FLASH_CPU_BACKWARD(
            dout[:, :, :t0], q[:, :, :t0], k[:, :, :t0], v[:, :, :t0], out[:, :, :t0], lse_text, 0.0, True, scale=scale
        )
        g = _FLASH_CPU_BACKWARD(di, qi, k[:, :, : t0 + 1], v[:, :, : t0 + 1], oi, lse_image, 0.0, False, scale=scale)
        dq[:, :, t0:] = g[0]
        dk[:, :, : t0 + 1] += g[1]
        dv[:, :, : t0 + 1] += g[2]
        # the self piece by hand: p = exp(s - lse); ds = p (dout . v_self - dout . out), as flash's backward does
        k_self, v_self = k[:, :, t0:], v[:, :, t0:]
        p = (_self_scores(qi, k_self, layout, scale) - lse_image).exp()
        ds = (p * (di.to(acc) * (v_self.to(acc) - oi.to(acc))).sum(-1) * scale)[..., None]
        dq[:, :, t0:] += ds * k_self
        dk[:, :, t0:] += ds * qi
        dv[:, :, t0:] += p[..., None] * di
        for i in range(layout.num_parts):
            _, inverse, keys, _ = layout.part(i)
            group, kp, vp, bias = _part_inputs(layout, i, qi, k, v)
            lse = group(lse_image[..., None])[..., 0]
            dqp, dkp, dvp = _FLASH_CPU_BACKWARD(
                group(di), group(qi), kp, vp, group(oi), lse, 0.0, False, attn_mask=bias, scale=scale
            )
            dqp = dqp.reshape(qi.shape)
            dq[:, :, t0:] += dqp if inverse is None else dqp.index_select(2, inverse)
            dk.index_add_(2, keys.flatten(), dkp.reshape(*k.shape[:2], -1, k.shape[-1]).to(acc))
            dv.index_add_(2, keys.flatten(), dvp.reshape(*v.shape[:2], -1, v.shape[-1]).to(acc))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
