"""A forward spy: proves which path ran (batch size of every forward, which cache it wrote).

A batched check that passes because it silently ran B=1 forwards, or a dynamic cache, proves nothing; every
batched verdict requires the spy's facts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.ar import cache as ar_cache

__all__ = ["ARForwardSpy", "ForwardCall"]


@dataclass(frozen=True)
class ForwardCall:
    batch: int
    queries: int
    cache: str  # class name, "none" without a cache
    dynamic: bool | None  # None without a cache


@dataclass
class ARForwardSpy:
    """Context manager recording every forward of ``model`` (a forward pre-hook; nothing inside is patched)."""

    model: Any
    calls: list[ForwardCall] = field(default_factory=list)
    _handle: Any = None

    def _hook(self, module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        self.calls.append(ForwardCall(
            batch=int(ids.shape[0]), queries=int(ids.shape[1]),
            cache="none" if cache is None else type(cache).__name__,
            dynamic=None if cache is None else ar_cache.is_dynamic(cache)))

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
