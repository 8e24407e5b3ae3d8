"""Decomposed kernel: causal rows and span rows partition the queries, outputs concatenate.

Every row of the structured mask sees a prefix of the keys: a causal row at position p sees [0, p],
a span row sees [0, span end) (an earlier image's row, [0, that image's end)). So the query rows split
into contiguous blocks that each need either a lower-right causal mask or no mask at all, and because
the blocks partition the rows (not the keys) their outputs merge by ``torch.cat`` with no log-sum-exp
merge.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.bias import causal_lower_right

from harness.attention import masks, primitives, reference
from harness.attention.layout import AttentionLayout
from harness.attention.reference import check_inputs

__all__ = ["RowBlock", "decomposed", "split_rows"]


@dataclass(frozen=True)
class RowBlock:
    """Query rows [start, stop) attending keys [0, kv_stop), causally (lower-right) or densely."""

    start: int
    stop: int
    kv_stop: int
    causal: bool

    @property
    def rows(self) -> int:
        return self.stop - self.start

    @property
    def pairs(self) -> int:
        return self.rows * self.kv_stop


def split_rows(layout: AttentionLayout) -> tuple[RowBlock, ...]:
    """Causal rows before each span, the span's rows, and causal rows after the last (empty blocks dropped)."""
    offset, q_len = layout.q_offset, layout.q_len
    blocks, row = [], 0
    for start, end in masks.image_spans(layout):
        lo = min(max(start - offset, row), q_len)
        hi = min(max(end - offset, lo), q_len)
        blocks += [RowBlock(row, lo, offset + lo, True), RowBlock(lo, hi, end, False)]
        row = hi
    blocks.append(RowBlock(row, q_len, offset + q_len, True))
    return tuple(b for b in blocks if b.rows > 0)


def _check_partition(blocks: tuple[RowBlock, ...], layout: AttentionLayout) -> None:
    edge = 0
    for block in blocks:
        if block.start != edge or block.rows <= 0 or not 0 < block.kv_stop <= layout.kv_len:
            raise ValueError(f"row blocks {blocks} do not partition the {layout.q_len} query rows of "
                             f"{layout.describe()} into non-empty blocks within {layout.kv_len} keys")
        edge = block.stop
    if edge != layout.q_len:
        raise ValueError(f"row blocks {blocks} cover {edge} of {layout.q_len} query rows")


def decomposed(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: AttentionLayout, *,
               scale: float | None = None) -> torch.Tensor:
    """One SDPA launch per row block, no dense mask, outputs concatenated along the query rows."""
    check_inputs(query, key, value, layout)
    scale = reference.resolve_scale(query, scale)
    blocks = split_rows(layout)
    _check_partition(blocks, layout)
    outputs = []
    for block in blocks:
        q = query[:, :, block.start:block.stop]
        k, v = key[:, :, :block.kv_stop], value[:, :, :block.kv_stop]
        bias = causal_lower_right(block.rows, block.kv_stop) if block.causal else None
        outputs.append(primitives.sdpa(q, k, v, attn_mask=bias, scale=scale))
    return torch.cat(outputs, dim=2)
