"""When the batched replay must decline and leave the work to the serial loop (docs/contracts.md, replay).

Each predicate is a seam, so an ablation can remove exactly one guard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from harness.replay.denoiser import Guidance, guidance_at
from harness.replay.sde import SDEStrategy

__all__ = [
    "ReplayConfig",
    "batching_enabled",
    "enough_steps",
    "fallback_reason",
    "guidance_is_constant",
    "is_stateless_sde",
    "resolve_config",
]


@dataclass(frozen=True)
class ReplayConfig:
    """Pipeline switches for replay; the batched path is opt-in (off by default)."""

    batch_replay_steps: bool = False


def resolve_config(config: ReplayConfig | None) -> ReplayConfig:
    """The switches a call runs under: a caller that passed none gets the defaults, the batched path off."""
    return config if config is not None else ReplayConfig()


def batching_enabled(config: ReplayConfig) -> bool:
    return bool(config.batch_replay_steps)


def enough_steps(steps: Sequence[int]) -> bool:
    """Stacking one step saves nothing; S <= 1 stays serial."""
    return len(steps) > 1


def is_stateless_sde(strategy: object) -> bool:
    """Only a stateless SDE may run S steps at once; a stateful solver reads step_index/history."""
    return isinstance(strategy, SDEStrategy) and bool(strategy.stateless)


def guidance_is_constant(guidance: Guidance | None, steps: Sequence[int]) -> bool:
    """One forward has one CFG scale; a per-step schedule that varies over the targets cannot fold."""
    scales = {guidance_at(guidance, step) for step in steps}
    return len(scales) <= 1


def fallback_reason(config: ReplayConfig, strategy: object, steps: Sequence[int],
                    guidance: Guidance | None) -> str | None:
    """Why the batched path declines, or None when it may run."""
    if not batching_enabled(config):
        return "batch_replay_steps is off"
    if not enough_steps(steps):
        return f"S={len(steps)} <= 1"
    if not is_stateless_sde(strategy):
        return f"strategy {type(strategy).__name__} is not a stateless SDE"
    if not guidance_is_constant(guidance, steps):
        return "guidance scale varies across the target steps"
    return None
