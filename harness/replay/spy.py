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
    """Batch size of every forward of one replay transformer (the rows of its first row argument: a tensor's dim 0,
    or a list of per-row tensors, for a transformer that takes one latent per sample), and the row-aligned tensors
    it was handed (every tensor argument with that many rows, held by reference): what ``harness.replay.diagnosis``
    traces a batched forward's rows back to the stock forwards' with."""

    batch_sizes: list[int] = field(default_factory=list)
    row_inputs: list[dict[str, torch.Tensor]] = field(default_factory=list)

    @property
    def calls(self) -> int:
        return len(self.batch_sizes)

    def hook(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        named = {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}
        rows = next((found for a in named.values() if (found := _rows(a)) is not None), -1)
        self.batch_sizes.append(rows)
        self.row_inputs.append({name: t for name, t in named.items()
                                if isinstance(t, torch.Tensor) and t.dim() and int(t.shape[0]) == rows})


def _rows(value: Any) -> int | None:
    """Rows of a row argument: a tensor's dim 0, a non-empty list's (tuple's) tensor items; None for anything else."""
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() else None
    if isinstance(value, (list, tuple)) and value and all(isinstance(item, torch.Tensor) for item in value):
        return len(value)
    return None


@contextlib.contextmanager
def spy_forwards(module: torch.nn.Module) -> Iterator[ReplayForwardSpy]:
    """Record every forward of ``module`` while the block runs."""
    spy = ReplayForwardSpy()
    handle = module.register_forward_pre_hook(spy.hook, with_kwargs=True)
    try:
        yield spy
    finally:
        handle.remove()
