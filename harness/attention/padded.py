"""Block-padded kernel: Q and KV padded to a multiple of the block, the mask kept consistent.

Block-tiled kernels want aligned lengths, and neither seed length is aligned (5348 % 128 == 100;
denoise 4099 / 5345). Padding is only exact if every real row keeps the pad keys masked out, and
pad rows see something (a fully masked row has no defined softmax) before they are sliced off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from harness.attention import masks, primitives, reference
from harness.attention.layout import AttentionLayout
from harness.attention.reference import check_inputs

__all__ = ["BLOCK", "block_padded", "pad_mask", "padded_length"]

BLOCK = 128


def padded_length(length: int, block: int = BLOCK) -> int:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block size must be a positive int, got {block!r}")
    return -(-length // block) * block


def pad_mask(mask: torch.Tensor, q_pad: int, kv_pad: int) -> torch.Tensor:
    """(Q, KV) -> (q_pad, kv_pad): pad keys invisible to every row; pad rows see every real key."""
    q_len, kv_len = mask.shape
    if q_pad < q_len or kv_pad < kv_len:
        raise ValueError(f"cannot pad a {q_len} x {kv_len} mask down to {q_pad} x {kv_pad}")
    out = mask.new_zeros(q_pad, kv_pad)
    out[:q_len, :kv_len] = mask
    out[q_len:, :kv_len] = True
    return out


def block_padded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: AttentionLayout, *,
                 scale: float | None = None, block: int = BLOCK) -> torch.Tensor:
    """Zero-pad q/k/v to block multiples, attend under the padded mask, drop the pad rows."""
    check_inputs(query, key, value, layout)
    scale = reference.resolve_scale(query, scale)
    q_len, kv_len = layout.q_len, layout.kv_len
    q_pad, kv_pad = padded_length(q_len, block), padded_length(kv_len, block)
    q = F.pad(query, (0, 0, 0, q_pad - q_len))
    k = F.pad(key, (0, 0, 0, kv_pad - kv_len))
    v = F.pad(value, (0, 0, 0, kv_pad - kv_len))
    mask = pad_mask(masks.build_mask(layout, device=query.device), q_pad, kv_pad)
    return primitives.sdpa(q, k, v, attn_mask=mask, scale=scale)[:, :, :q_len]
