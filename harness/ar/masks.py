"""Attention masks of the batched AR path over a static KV cache (bool, True = may attend).

A static cache returns its full ``max_cache_len`` key axis: right-padded pad KV and never-written tail slots
included. Upstream deletes the mask at decode ("full attention of 1 x seqlen"), which is only right for a
cache trimmed to the valid length, so the batched path supplies a per-row decode mask.
"""

from __future__ import annotations

import torch

from harness.ar.batch import pad_seq

__all__ = ["decode_mask", "prefill_mask"]


def prefill_mask(attention_mask: torch.Tensor, key_length: int) -> torch.Tensor:
    """Right-pad the prefill mask's key axis ``[B, 1, L, L] -> [B, 1, L, key_length]`` with False."""
    if attention_mask.dtype != torch.bool or attention_mask.dim() != 4:
        raise TypeError(f"prefill mask must be bool [B, 1, L, L], got {attention_mask.dtype} "
                        f"{tuple(attention_mask.shape)}")
    return pad_seq(attention_mask, key_length, 3, False)


def decode_mask(key_valid: torch.Tensor) -> torch.Tensor | None:
    """Per-row decode mask ``[..., B, 1, 1, K]`` admitting exactly each row's valid keys (``key_valid [..., B, K]``;
    leading dimensions: several steps' masks at once)."""
    return key_valid.reshape(*key_valid.shape[:-1], 1, 1, key_valid.shape[-1])
