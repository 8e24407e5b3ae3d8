"""What a replay family is: an adapter (CFG layout and combine included) plus the checkpoint kind it drives.

A family adapter wraps a loaded transformer. Beyond the replay contract (``DenoiserAdapter``) it
knows its latent layout and can build seeded example conditions of the right shapes from the
model's own config, so the gpu tier can replay any registered family's checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.plugins import CheckpointKind
from harness.replay import conditions as replay_rows
from harness.replay.conditions import Conditions
from harness.replay.denoiser import DenoiserAdapter

__all__ = ["ModelAdapter", "ReplayFamily"]


class ModelAdapter(DenoiserAdapter):
    """A real transformer behind the replay contract; subclasses set cfg_layout / cfg_combine."""

    def __init__(self, transformer: torch.nn.Module):
        self.module = transformer

    def require_rows(self, conditions: Conditions, names: tuple[str, ...], rows: int) -> None:
        """Every named row field has exactly the forward's ``rows`` (the harness broadcasts, never the adapter)."""
        for name in names:
            if name not in conditions.rows:
                raise ValueError(f"{type(self).__name__}: row field {name!r} is missing; got {sorted(conditions.rows)}")
            replay_rows.require_rows(type(self).__name__, name, conditions.rows[name], rows)

    @property
    def latent_shape(self) -> tuple[int, ...]:  # pragma: no cover - abstract
        """The per-sample latent shape replay stores and steps (the pipeline's own layout)."""
        raise NotImplementedError

    def example_conditions(self, batch: int, cfg: int,
                           generator: torch.Generator) -> Conditions:  # pragma: no cover - abstract
        """Seeded conditions for ``batch`` samples; ``cfg=2`` adds the uncond branch in the family's layout."""
        raise NotImplementedError


@dataclass(frozen=True)
class ReplayFamily:
    """A registered replay family: its adapter class (layout + combine) and its checkpoint kind."""

    name: str
    adapter_class: type[ModelAdapter]
    checkpoint_kind: CheckpointKind

    def __post_init__(self) -> None:
        kind = self.checkpoint_kind
        if kind.feeds != "replay" or kind.family != self.name:
            raise ValueError(f"replay family {self.name!r}: its checkpoint kind {kind.name!r} must feed 'replay' "
                             f"with family={self.name!r}, got feeds={kind.feeds!r}, family={kind.family!r}")

    @property
    def cfg_layout(self) -> str:
        return self.adapter_class.cfg_layout

    @property
    def cfg_combine(self) -> str:
        return self.adapter_class.cfg_combine

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.checkpoint_kind.class_names

    def adapter(self, transformer: torch.nn.Module) -> ModelAdapter:
        return self.adapter_class(transformer)


def check_cfg(cfg: int) -> None:
    if cfg not in (1, 2):
        raise ValueError(f"cfg must be 1 (no guidance) or 2 (two CFG branches), got {cfg!r}")
