"""Record the primitive launches a kernel makes, so a check can prove the fast path ran.

The recorder wraps ``primitives.launch_sdpa`` / ``primitives.launch_flex`` (the calls into torch, after
the key/value heads are decided) for the duration of a block and always restores them; the primitives
look them up through their module at call time, so every kernel's launches are seen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention.bias import CausalBias
from torch.nn.attention.flex_attention import BlockMask

from harness.attention import primitives

__all__ = ["Launch", "recording"]


@dataclass(frozen=True)
class Launch:
    """One primitive call: which primitive, q/kv shapes (B, H, S, D), and how it was masked."""

    primitive: str
    q_shape: tuple[int, ...]
    kv_shape: tuple[int, ...]
    mask: str  # "none", "is_causal", "causal_bias", "bool", "block_mask"
    mask_shape: tuple[int, ...] = ()
    block_mask: Any = None

    @property
    def rows(self) -> int:
        return self.q_shape[2]

    @property
    def keys(self) -> int:
        return self.kv_shape[2]


def _mask_kind(attn_mask: Any, is_causal: bool) -> tuple[str, tuple[int, ...]]:
    if isinstance(attn_mask, CausalBias):
        return "causal_bias", ()
    if isinstance(attn_mask, torch.Tensor):
        return ("bool" if attn_mask.dtype == torch.bool else "additive"), tuple(attn_mask.shape)
    return ("is_causal" if is_causal else "none"), ()


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    launches: list[Launch] = []
    sdpa, flex = primitives.launch_sdpa, primitives.launch_flex

    def sdpa_spy(query, key, value, *, attn_mask=None, is_causal=False, scale, enable_gqa):
        kind, shape = _mask_kind(attn_mask, is_causal)
        launches.append(Launch("sdpa", tuple(query.shape), tuple(key.shape), kind, shape))
        return sdpa(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    def flex_spy(query, key, value, *, block_mask: BlockMask, scale, enable_gqa):
        launches.append(Launch("flex", tuple(query.shape), tuple(key.shape), "block_mask",
                               tuple(block_mask.shape), block_mask))
        return flex(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)

    primitives.launch_sdpa, primitives.launch_flex = sdpa_spy, flex_spy
    try:
        yield launches
    finally:
        primitives.launch_sdpa, primitives.launch_flex = sdpa, flex
