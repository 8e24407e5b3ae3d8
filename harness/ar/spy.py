"""A forward spy: proves which path ran (batch size of every forward, which cache it wrote, which side its
prefill rows were padded on).

A batched check that passes because it silently ran B=1 forwards, or a dynamic cache, proves nothing; every
batched verdict requires the spy's facts. Given the pad id, the spy also reads where each row of a multi-token
forward (the prefill) holds its pads: what an implementation actually handed the model, whatever layout it
declares (harness.ar.judge.require_layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from harness.ar import cache as ar_cache

__all__ = ["ARForwardSpy", "ForwardCall", "empty_query_rows", "row_padding"]


@dataclass(frozen=True)
class ForwardCall:
    batch: int
    queries: int
    cache: str  # class name, "none" without a cache
    dynamic: bool | None  # None without a cache
    pads: tuple[str, ...] = ()  # per row of a multi-token forward, where its pads sit (``row_padding``)
    empty_queries: int | None = None  # query rows of a 4-D bool mask that admit no key (None: no such mask)
    slots: int | None = None  # a static cache's slots per row, once its buffers exist (None: not yet, or none)


def empty_query_rows(mask: Any) -> int | None:
    """How many query rows of a ``[B, 1, Q, K]`` mask admit no key: under an eager ``-inf`` softmax each is a NaN
    row, whose KV then poisons every row that reads it. A bool mask admits where True, an additive one where its
    bias lies above half its dtype's lowest value (-inf and the lowest value both forbid); None for any other mask
    (2-D, none)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return None
    if mask.dtype == torch.bool:
        admitted = mask
    elif mask.is_floating_point():
        admitted = mask > torch.finfo(mask.dtype).min / 2
    else:
        return None
    return int((~admitted.any(dim=-1)).sum())


def cache_slots(cache: Any) -> int | None:
    """A static cache's slots per row, read off its first layer's buffers; None for no cache, a dynamic one, or one
    whose buffers the first forward has yet to allocate."""
    if cache is None or ar_cache.is_dynamic(cache):
        return None
    try:
        return int(ar_cache.layer_buffers(cache)[0][0].shape[2])
    except (ValueError, AttributeError, IndexError):
        return None


def row_padding(input_ids: torch.Tensor, pad_id: int) -> tuple[str, ...]:
    """Where each row of ``input_ids [B, L]`` holds the pad id: ``"left"`` (a prefix), ``"right"`` (a suffix),
    ``"none"``, or ``"inside"`` (anywhere else, or on both ends)."""
    is_pad = input_ids == pad_id
    count = is_pad.sum(dim=-1)
    leading = is_pad.long().cumprod(dim=-1).sum(dim=-1)
    trailing = is_pad.flip(-1).long().cumprod(dim=-1).sum(dim=-1)
    sides = []
    for n, lead, trail in zip(count.tolist(), leading.tolist(), trailing.tolist(), strict=True):
        sides.append("none" if n == 0 else "left" if lead == n else "right" if trail == n else "inside")
    return tuple(sides)


@dataclass
class ARForwardSpy:
    """Context manager recording every forward of ``model`` (a forward pre-hook; nothing inside is patched); with
    ``pad_id`` it also records each multi-token forward's row padding."""

    model: Any
    pad_id: int | None = None
    calls: list[ForwardCall] = field(default_factory=list)
    _handle: Any = None

    def _hook(self, module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        queries = int(ids.shape[1])
        self.calls.append(ForwardCall(
            batch=int(ids.shape[0]), queries=queries,
            cache="none" if cache is None else type(cache).__name__,
            dynamic=None if cache is None else ar_cache.is_dynamic(cache),
            pads=row_padding(ids, self.pad_id) if self.pad_id is not None and queries > 1 else (),
            empty_queries=empty_query_rows(kwargs.get("attention_mask")) if queries > 1 else None,
            slots=cache_slots(cache)))

    def __enter__(self) -> ARForwardSpy:
        self.calls.clear()
        self._handle = self.model.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()

    @property
    def batch_sizes(self) -> list[int]:
        return [c.batch for c in self.calls]

    @property
    def static(self) -> bool:
        """Every forward wrote a preallocated (non-dynamic) cache."""
        return bool(self.calls) and all(c.dynamic is False for c in self.calls)

    @property
    def dynamic(self) -> bool:
        return bool(self.calls) and all(c.dynamic is True for c in self.calls)

    @property
    def prefill_empty_queries(self) -> int | None:
        """Query rows of the prefill's 4-D mask (bool or additive) that admit no key; None when it handed the model
        no such mask."""
        return next((c.empty_queries for c in self.calls if c.queries > 1), None)

    @property
    def prefill_pads(self) -> tuple[str, ...]:
        """Where each row of the first multi-token forward (the prefill) held its pads; () when none was seen or the
        spy was not given the pad id."""
        return next((c.pads for c in self.calls if c.pads), ())
