"""The sparse patterns on CUDA through FlexAttention: the tiles a pattern masks whole are never computed.

`FlexLayout` holds one pattern's block mask, made once by `create_block_mask` from the same dense boolean mask
SDPA takes (attention_mask): which (query tile, key tile) pairs hold any allowed score (the others are skipped),
and which hold only allowed scores (computed without reading the mask). `attend` runs flex_attention compiled
(once per shape: torch.compile is what turns it into one fused kernel; a compiled caller inlines it) over the
whole sequence, or, decoding, for the one query row at `pos` over the static cache, with the tiles of that
row's query tile. The mask_mod reads the dense mask, so the function is SDPA's with that mask
(tests/models/test_flex_attention.py on the CPU, bench/gpu.py's outputs and gradients on a GPU).

Flex serves the devices in DEVICES (CUDA: the CPU keeps its fused pieces, sparse_attention.py, whose backward
flex lacks there), without attention dropout (flex has none), on torch >= 2.5.
"""

from __future__ import annotations

import torch
from torch import nn

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # torch < 2.5: the sparse pieces serve every device
    BlockMask = create_block_mask = flex_attention = None

BLOCK = 128  # flex_attention's default tile side
DEVICES = ("cuda",)  # device types flex serves (the tests add "cpu" to run its forward there)
_COMPILED: dict = {}


def available() -> bool:
    """Whether models built now get flex layouts: flex exists and a device it serves does."""
    return flex_attention is not None and ("cpu" in DEVICES or ("cuda" in DEVICES and torch.cuda.is_available()))


def serves(q: torch.Tensor, layout: FlexLayout | None, dropout: float = 0.0) -> bool:
    return layout is not None and not dropout and q.device.type in DEVICES


def compiled_flex():
    """flex_attention through torch.compile, made once; each new shape (batch, dtype, decode) compiles once."""
    if "flex" not in _COMPILED:
        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED["flex"]


class FlexLayout(nn.Module):
    """One pattern's tiles over the sequence of n positions, as buffers (they follow the model to its device):
    per query tile, how many and which key tiles hold allowed scores, and which of them hold only allowed ones."""

    def __init__(self, mask: torch.Tensor, block: int | tuple[int, int] | None = None):
        super().__init__()
        n, block = mask.shape[0], block or BLOCK  # BLOCK (query, key) tile sides: one int for both
        if min((block, block) if isinstance(block, int) else block) < 16:  # compiled flex computes garbage there
            raise ValueError(f"FlexAttention tiles must be at least 16 positions wide (got {block})")
        self.n, self.block = n, block
        blocks = create_block_mask(lambda b, h, q, kv: mask[q, kv], None, None, n, n, device="cpu", BLOCK_SIZE=block)
        self.register_buffer("mask", mask.clone(), persistent=False)
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            self.register_buffer(name, getattr(blocks, name), persistent=False)
        # the fraction of the n x n score tiles computed (the rest skipped)
        tiles = self.kv_indices.shape[-2] * self.kv_indices.shape[-1]
        self.computed_fraction = float(self.kv_num_blocks.sum() + self.full_kv_num_blocks.sum()) / tiles

    def block_mask(self, pos: torch.Tensor | None = None):
        """The whole sequence's BlockMask, or (pos: 0-dim position tensor) the one query row at `pos` over all
        n keys: the tiles of its query tile. No shape depends on pos, so every decode step shares one graph."""
        mask, block = self.mask, self.block
        q_block = block if isinstance(block, int) else block[0]
        if pos is None:
            rows, lengths = (lambda t: t), (self.n, self.n)

            def mask_mod(b, h, q, kv):
                return mask[q, kv]
        else:
            tile = (pos // q_block).view(1)
            rows, lengths = (lambda t: t.index_select(2, tile)), (1, self.n)

            def mask_mod(b, h, q, kv):
                return mask[pos + q, kv]

        return BlockMask.from_kv_blocks(
            rows(self.kv_num_blocks), rows(self.kv_indices), rows(self.full_kv_num_blocks), rows(self.full_kv_indices),
            BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=lengths,
        )  # fmt: skip


def attend(q, k, v, layout: FlexLayout, pos: torch.Tensor | None = None) -> torch.Tensor:
    """(b, h, m, d) -> (b, h, m, d): SDPA with the pattern's dense mask, through flex_attention. m = n (the whole
    sequence), or m = 1 at position `pos` over the cache's n keys. Queries and keys take the values' dtype, as
    SDPA's autocast does (--qk_norm's LayerNorm gives fp32 under autocast)."""
    return compiled_flex()(q.to(v.dtype), k.to(v.dtype), v, block_mask=layout.block_mask(pos))
