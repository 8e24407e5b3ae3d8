"""flex attention kernel: the structured mask as a mask_mod plus a BlockMask at a block size.

The mask_mod is ``masks.visibility`` shifted to absolute positions, so flex and the dense builder
share one definition. The BlockMask is derived from that mask_mod evaluated by broadcasting over
the (Q, KV) grid and reduced per tile, exactly as ``create_block_mask`` lays it out (partial and full
blocks, True indices first), but without its per-element vmap (~1 s at S = 5348 on CPU).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask

from harness.attention import masks, primitives, reference
from harness.attention.layout import AttentionLayout
from harness.attention.padded import BLOCK, padded_length
from harness.attention.reference import check_inputs

__all__ = ["block_mask_for", "blocks_from_dense", "flex_structured", "mask_mod_for", "tile_grids"]


def mask_mod_for(layout: AttentionLayout) -> Callable[..., torch.Tensor]:
    """flex's ``mask_mod(b, h, q_idx, kv_idx)`` for ``layout`` (query rows shifted by q_offset)."""
    *images, span = masks.image_spans(layout)
    specials = layout.special_positions
    offset = layout.q_offset

    def mask_mod(b, h, q_idx, kv_idx):
        return masks.visibility(q_idx + offset, kv_idx, span, specials, tuple(images))

    return mask_mod


def tile_grids(dense: torch.Tensor, block: int, kv_block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(any visible, all visible) per (q tile, kv tile) of ``block`` x ``kv_block`` (default square) tiles;
    out-of-range pad counts as invisible."""
    kv_block = block if kv_block is None else kv_block
    q_len, kv_len = dense.shape
    q_pad, kv_pad = padded_length(q_len, block), padded_length(kv_len, kv_block)
    grid = dense.new_zeros(q_pad, kv_pad)
    grid[:q_len, :kv_len] = dense
    tiles = grid.view(q_pad // block, block, kv_pad // kv_block, kv_block)
    return tiles.any(dim=3).any(dim=1), tiles.all(dim=3).all(dim=1)


def _ordered(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    count = selected.sum(dim=-1).to(torch.int32)
    tiles = torch.arange(selected.shape[-1], device=selected.device)
    # selected tiles first, each group in tile order: the keys are unique, so no sort has to be stable
    order = torch.argsort(torch.where(selected, tiles, tiles + selected.shape[-1]), dim=-1).to(torch.int32)
    return count[None, None], order[None, None]


def blocks_from_dense(dense: torch.Tensor, block: int, mask_mod: Callable[..., torch.Tensor]) -> BlockMask:
    """A (1, 1, Q, KV) BlockMask whose tiles are classified from the dense mask."""
    any_visible, all_visible = tile_grids(dense, block)
    kv_num, kv_idx = _ordered(any_visible & ~all_visible)
    full_num, full_idx = _ordered(all_visible)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=tuple(dense.shape))


def block_mask_for(layout: AttentionLayout, *, block: int = BLOCK,
                   device: torch.device | str | None = None) -> BlockMask:
    mask_mod = mask_mod_for(layout)
    q_idx = torch.arange(layout.q_len, device=device)[:, None]
    kv_idx = torch.arange(layout.kv_len, device=device)[None, :]
    return blocks_from_dense(mask_mod(None, None, q_idx, kv_idx), block, mask_mod)


def flex_structured(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: AttentionLayout, *,
                    scale: float | None = None, block: int = BLOCK) -> torch.Tensor:
    """flex_attention under the layout's BlockMask (GQA through enable_gqa)."""
    check_inputs(query, key, value, layout)
    block_mask = block_mask_for(layout, block=block, device=query.device)
    return primitives.flex(query, key, value, block_mask=block_mask, scale=reference.resolve_scale(query, scale))
