"""Count a replay transformer's forwards and their batch sizes, so a check can prove which path ran."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ReplayForwardSpy", "spy_forwards"]


@dataclass
class ReplayForwardSpy:
    """Batch size (rows of the first tensor argument) of every forward of one replay transformer."""

    batch_sizes: list[int] = field(default_factory=list)

    @property
    def calls(self) -> int:
        return len(self.batch_sizes)

    def hook(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        self.batch_sizes.append(int(first.shape[0]) if first is not None and first.dim() else -1)


@contextlib.contextmanager
def spy_forwards(module: torch.nn.Module) -> Iterator[ReplayForwardSpy]:
    """Record every forward of ``module`` while the block runs."""
    spy = ReplayForwardSpy()
    handle = module.register_forward_pre_hook(spy.hook, with_kwargs=True)
    try:
        yield spy
    finally:
        handle.remove()
