"""KV-cache choice and the small cache operations the batched loop needs.

``cache_is_dynamic`` is the seam of the AR issue's crash (docs/contracts.md): upstream's dynamic cache trims the
returned KV to one scalar end position, which cannot represent per-row right-padding, and asserts batch 1.
Everything else here reads or restores cache slots through the per-layer ``keys``/``values`` buffers that
transformers' caches (and upstream's subclass) expose.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import StaticCache

__all__ = [
    "cache_is_dynamic",
    "fill_slots",
    "is_dynamic",
    "layer_buffers",
    "preallocate",
    "restore_slots",
    "snapshot_slots",
]


def cache_is_dynamic(batch_size: int) -> bool:
    """Dynamic (trimmed) cache only at B == 1: upstream's stock path, bit-identical there."""
    return batch_size == 1


def is_dynamic(cache: Any) -> bool:
    """True for upstream's ``dynamic=True`` cache and for any cache without preallocated slots."""
    if hasattr(cache, "dynamic"):
        return bool(cache.dynamic)
    return not isinstance(cache, StaticCache)


def layer_buffers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The raw ``(keys, values)`` buffers of every layer, ``[B, H_kv, slots, head_dim]`` each."""
    buffers = []
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "keys", None) is None or not getattr(layer, "is_initialized", True):
            raise ValueError(f"cache layer {i} holds no KV yet (run the prefill first)")
        buffers.append((layer.keys, layer.values))
    return buffers


def snapshot_slots(cache: Any, rows: torch.Tensor, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copy slot ``slots[r]`` of every row ``r`` in ``rows`` (bool ``[B]``), for every layer."""
    index = rows.nonzero().squeeze(-1)
    cols = slots[index]
    return [(k[index, :, cols], v[index, :, cols]) for k, v in layer_buffers(cache)]  # advanced indexing copies


def restore_slots(cache: Any, rows: torch.Tensor, slots: torch.Tensor,
                  saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write back what ``snapshot_slots`` copied: those rows' writes of this step never happened."""
    index = rows.nonzero().squeeze(-1)
    cols = slots[index]
    for (k, v), (k_saved, v_saved) in zip(layer_buffers(cache), saved, strict=True):
        k[index, :, cols] = k_saved
        v[index, :, cols] = v_saved


def preallocate(cache: Any, batch_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device, fill: float) -> None:
    """Allocate a static cache's buffers before the prefill and fill them (probes plant NaN in unused slots)."""
    if is_dynamic(cache):
        raise ValueError("only a static (preallocated) cache can be filled before the run")
    cache.early_initialization(batch_size, kv_heads, head_dim, dtype, device)
    for k, v in layer_buffers(cache):
        k.fill_(fill)
        v.fill_(fill)


def fill_slots(cache: Any, slots: torch.Tensor, value: float) -> int:
    """Set every slot where ``slots [B, max_cache_len]`` is True to ``value`` in every layer; returns the count."""
    for k, v in layer_buffers(cache):
        k.masked_fill_(slots[:, None, :, None].to(k.device), value)
        v.masked_fill_(slots[:, None, :, None].to(v.device), value)
    return int(slots.sum())
