"""An attention kernel from outside the suite, put under test with ``--impl attention=MODULE:CALLABLE``.

``attend`` is right: it builds HunyuanImage-3's structured mask from the layout itself (causal text,
a bidirectional image span, special rows that never join the span) and runs one masked SDPA.
``attend_causal_only`` is the known bug the suite must catch: ``is_causal`` alone, bottom-right
aligned, which drops the image block (image rows stop seeing the later image keys).

Both keep the suite's documented signature ``kernel(query, key, value, layout, *, scale=None)`` with
query (B, H, Q, D), key/value (B, Hkv, KV, D), Hkv dividing H (GQA); ``layout`` is a
``harness.attention.layout.AttentionLayout`` (text_len, image_len, special_len, phase).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["attend", "attend_causal_only", "structured_mask"]


def structured_mask(layout, device: torch.device | str | None = None) -> torch.Tensor:
    """(Q, KV) bool, True = may attend; query row r sits at absolute position kv_len - q_len + r."""
    start, end = layout.text_len, layout.text_len + layout.image_len
    if layout.phase == "prefill":
        special_lo, special_hi = end, end + layout.special_len
    else:  # denoise re-queries the special rows just before the span, then the span
        special_lo, special_hi = start - layout.special_len, start
    q_pos = torch.arange(layout.kv_len - layout.q_len, layout.kv_len, device=device)[:, None]
    kv_pos = torch.arange(layout.kv_len, device=device)[None, :]
    causal = kv_pos <= q_pos
    in_span = (q_pos >= start) & (q_pos < end) & (kv_pos >= start) & (kv_pos < end)
    special = (q_pos >= special_lo) & (q_pos < special_hi)
    return torch.where(special, causal, causal | in_span)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout, *,
           scale: float | None = None) -> torch.Tensor:
    """One masked SDPA under the structured mask."""
    return F.scaled_dot_product_attention(query, key, value, attn_mask=structured_mask(layout, query.device),
                                          scale=scale, enable_gqa=query.shape[1] != key.shape[1])


def attend_causal_only(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout, *,
                       scale: float | None = None) -> torch.Tensor:
    """The bug: causal (bottom-right aligned) everywhere, so the image span is not bidirectional."""
    q_pos = torch.arange(layout.kv_len - layout.q_len, layout.kv_len, device=query.device)[:, None]
    causal = torch.arange(layout.kv_len, device=query.device)[None, :] <= q_pos
    return F.scaled_dot_product_attention(query, key, value, attn_mask=causal, scale=scale,
                                          enable_gqa=query.shape[1] != key.shape[1])
