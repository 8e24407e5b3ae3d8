"""The reference kernel (masked SDPA), the mask-free approximation, and the shared input contract.

Every kernel takes ``(query, key, value, layout, *, scale=None)`` with q (B, H, Q, D) and k/v
(B, Hkv, KV, D), Hkv dividing H (GQA), and returns (B, H, Q, D).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.nn.attention.bias import causal_lower_right

from harness.attention import masks, primitives
from harness.attention.layout import AttentionLayout

__all__ = ["Kernel", "attend_masked", "check_inputs", "expand_kv", "mask_free", "masked_sdpa", "resolve_scale"]


class Kernel(Protocol):
    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: AttentionLayout, *,
                 scale: float | None = None) -> torch.Tensor: ...


def check_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: AttentionLayout) -> None:
    """Reject inputs that do not fit ``layout`` with a message naming what was expected."""
    if not isinstance(layout, AttentionLayout):
        raise TypeError(f"layout must be an AttentionLayout, got {type(layout).__name__}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be (B, H, S, D) heads-first, got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have one shape")
    if query.dtype != key.dtype or query.dtype != value.dtype:
        raise TypeError(f"query/key/value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}")
    batch, heads, q_len, dim = query.shape
    kv_batch, kv_heads, kv_len, kv_dim = key.shape
    if batch != kv_batch or dim != kv_dim:
        raise ValueError(f"query (B={batch}, D={dim}) and key (B={kv_batch}, D={kv_dim}) must share batch and head dim")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key/value heads (GQA groups)")
    if q_len != layout.q_len or kv_len != layout.kv_len:
        raise ValueError(f"inputs hold Q {q_len} x KV {kv_len} but the layout ({layout.describe()}) needs "
                         f"Q {layout.q_len} x KV {layout.kv_len}")


def resolve_scale(query: torch.Tensor, scale: float | None) -> float:
    """The scale a kernel computes at: the one passed, else 1 / sqrt(D). A seam: every kernel looks it up through
    this module at call time."""
    return query.shape[-1] ** -0.5 if scale is None else float(scale)


def expand_kv(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Repeat each key/value head over its GQA group (head h uses kv head h // group), like repeat_kv."""
    kv_heads = tensor.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key/value heads")
    return tensor.repeat_interleave(heads // kv_heads, dim=1)


def attend_masked(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, *,
                  scale: float) -> torch.Tensor:
    """Masked SDPA on an explicit (Q, KV) or (B, 1, Q, KV) bool mask, e.g. a capture's."""
    return primitives.sdpa(query, key, value, attn_mask=mask, scale=scale)


def masked_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: AttentionLayout, *,
                scale: float | None = None) -> torch.Tensor:
    """The reference: SDPA with the full (Q, KV) structured mask."""
    check_inputs(query, key, value, layout)
    mask = masks.build_mask(layout, device=query.device)
    return attend_masked(query, key, value, mask, scale=resolve_scale(query, scale))


def mask_free(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: AttentionLayout, *,
              scale: float | None = None) -> torch.Tensor:
    """is_causal only (bottom-right aligned at denoise): drops the image block. NOT a valid kernel here."""
    check_inputs(query, key, value, layout)
    scale = resolve_scale(query, scale)
    if layout.q_len == layout.kv_len:
        return primitives.sdpa(query, key, value, is_causal=True, scale=scale)
    return primitives.sdpa(query, key, value, attn_mask=causal_lower_right(layout.q_len, layout.kv_len), scale=scale)
