"""Mask construction for the structured layout, one small seam per rule.

The rules are elementwise and broadcast over position tensors, so the same functions build the dense
(Q, KV) mask here and serve as flex attention's ``mask_mod`` (scalar positions under vmap). Every
rule is looked up through this module at call time, so an ablation patched over one of them reaches
every kernel that uses it.
"""

from __future__ import annotations

import torch

from harness.attention.layout import AttentionLayout

__all__ = [
    "build_mask",
    "causal_mask",
    "causal_only",
    "image_span_mask",
    "image_spans",
    "positions",
    "span_bounds",
    "special_row_visibility",
    "visibility",
]


def span_bounds(layout: AttentionLayout) -> tuple[int, int]:
    """[start, end) of the bidirectional image block in absolute positions."""
    return layout.text_len, layout.text_len + layout.image_len


def image_spans(layout: AttentionLayout) -> tuple[tuple[int, int], ...]:
    """Every bidirectional block in order: the prompt's earlier images, then the generated image's span."""
    return (*layout.images, span_bounds(layout))


def causal_mask(q_pos: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
    """Each query sees itself and every earlier position."""
    return kv_pos <= q_pos


def image_span_mask(q_pos: torch.Tensor, kv_pos: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """The dense rectangular block: a query inside the span sees every key inside the span."""
    q_inside = (q_pos >= start) & (q_pos < end)
    kv_inside = (kv_pos >= start) & (kv_pos < end)
    return q_inside & kv_inside  # one (Q, KV) op when the positions broadcast


def special_row_visibility(q_pos: torch.Tensor, kv_pos: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Special tokens attend causally and never join the image block (at denoise: the text prefix only)."""
    return causal_mask(q_pos, kv_pos)


def visibility(q_pos: torch.Tensor, kv_pos: torch.Tensor, span: tuple[int, int],
               specials: tuple[int, int], images: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
    """May query position ``q_pos`` attend to key position ``kv_pos``? Broadcasts; vmap-safe. ``images`` are
    the earlier image blocks, bidirectional like ``span``."""
    start, end = span
    lo, hi = specials
    structured = causal_mask(q_pos, kv_pos) | image_span_mask(q_pos, kv_pos, start, end)
    for image_start, image_end in images:
        structured = structured | image_span_mask(q_pos, kv_pos, image_start, image_end)
    is_special = (q_pos >= lo) & (q_pos < hi)
    return torch.where(is_special, special_row_visibility(q_pos, kv_pos, start, end), structured)


def positions(layout: AttentionLayout, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(query positions as a column, key positions as a row), ready to broadcast to (Q, KV)."""
    q_pos = torch.arange(layout.q_offset, layout.kv_len, device=device)[:, None]
    kv_pos = torch.arange(layout.kv_len, device=device)[None, :]
    return q_pos, kv_pos


def build_mask(layout: AttentionLayout, device: torch.device | str | None = None) -> torch.Tensor:
    """The (Q, KV) bool mask of ``layout``; True = may attend."""
    q_pos, kv_pos = positions(layout, device)
    *images, span = image_spans(layout)
    return visibility(q_pos, kv_pos, span, layout.special_positions, tuple(images))


def causal_only(layout: AttentionLayout, device: torch.device | str | None = None) -> torch.Tensor:
    """The mask an is_causal-only kernel applies (bottom-right aligned); NOT a valid approximation here."""
    q_pos, kv_pos = positions(layout, device)
    return causal_mask(q_pos, kv_pos)
