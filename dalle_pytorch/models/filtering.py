"""What both samplers share, sequential sampling (sampling.py) and speculative Jacobi decoding (sjd.py): the logits
they draw from (top-k and top-p filtering) and the uniform noise they draw with (one generator, or one per row)."""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Logits with -inf outside the top-k set and outside the smallest set whose probability reaches top_p."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
        drop_sorted = before >= top_p  # keeps the first token always
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class Noise:
    """Uniform noise for the rows of a batch: from one generator for the batch, or from each row's own (a list
    of one per row: row i's values are those of torch.rand(shape, generator=generator[i]), whatever the batch)."""

    def __init__(self, generator, rows: int, device):
        self.generator, self.rows, self.device = generator, rows, device
        self.per_row = isinstance(generator, (list, tuple))
        if self.per_row and len(generator) != rows:
            raise ValueError(f"{len(generator)} generators for {rows} caption rows: give one per row, or one for all")

    def __call__(self, *shape: int) -> torch.Tensor:
        if self.per_row:
            return torch.stack([torch.rand(shape, device=self.device, generator=g) for g in self.generator])
        return torch.rand((self.rows, *shape), device=self.device, generator=self.generator)
