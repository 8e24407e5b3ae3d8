"""One replay problem: an adapter, its conditions, a trajectory rolled out by the stock path, the targets.

``make_problem`` rolls the segment out with the stock path only (no seam an ablation patches), so
a problem may be cached across a kill matrix. The default geometry (T=8, SDE on 5 steps, every SDE
step replayed) is what the CPU and GPU tiers share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.replay.conditions import Conditions
from harness.replay.denoiser import DenoiserAdapter, Guidance
from harness.replay.guards import ReplayConfig
from harness.replay.rollout import flow_sigmas, rollout
from harness.replay.sde import FlowGRPOSDE, SDEStrategy
from harness.replay.segment import TrajectorySegment

__all__ = ["DEFAULT_GUIDANCE", "DEFAULT_SDE_INDICES", "DEFAULT_STEPS", "ReplayProblem", "make_problem"]

DEFAULT_STEPS = 8
DEFAULT_SDE_INDICES = (0, 1, 3, 4, 6)
DEFAULT_GUIDANCE = 4.5
BATCHED = ReplayConfig(batch_replay_steps=True)  # the flag on: a check wants the fast path


@dataclass(frozen=True, eq=False)
class ReplayProblem:
    """Everything one replay call needs; the batched flag is on (a check wants the fast path)."""

    name: str
    adapter: DenoiserAdapter
    conditions: Conditions
    segment: TrajectorySegment
    strategy: SDEStrategy
    target: tuple[int, ...]
    guidance: Guidance | None
    config: ReplayConfig | None = field(default_factory=lambda: BATCHED)

    @property
    def steps(self) -> int:
        return len(self.target)

    @property
    def serial_rows(self) -> int:
        """Rows of one stock forward: cfg x B."""
        return self.conditions.forward_rows

    @property
    def batched_rows(self) -> int:
        """Rows of the one fast forward: S x cfg x B."""
        return self.steps * self.conditions.forward_rows

    def args(self) -> tuple[Any, ...]:
        """The positional arguments of replay_serial / replay_batched for this problem."""
        return (self.adapter, self.conditions, self.segment, self.strategy, self.target, self.guidance, self.config)

    def with_(self, **changes: Any) -> ReplayProblem:
        return dataclasses.replace(self, **changes)


def make_problem(name: str, adapter: DenoiserAdapter, conditions: Conditions, *, seed: int,
                 latent_shape: Sequence[int], target: Sequence[int] | None = None,
                 sde_indices: Sequence[int] | None = None, steps: int | None = None,
                 guidance: Guidance | None = None, strategy: SDEStrategy | None = None,
                 trajectory_dtype: torch.dtype = torch.bfloat16, dense: bool = False,
                 config: ReplayConfig | None = None, batched: bool = True) -> ReplayProblem:
    """Roll out a seeded trajectory with the stock path and wrap it as a replay problem.

    Left out: T = DEFAULT_STEPS, SDE on DEFAULT_SDE_INDICES, every SDE step replayed (``target`` =
    ``sde_indices``), CFG scale DEFAULT_GUIDANCE, Flow-GRPO with eta 0.7, a bf16 trajectory stored sparsely (the
    latents replay needs), the batched flag on. ``batched=False`` with ``config=None`` hands the replay no config
    at all (a caller that never set one: the batched path must decline). The noise comes from its own stream,
    ``seed + 1000``, so it shares no draws with conditions built from ``seed``.
    """
    steps = DEFAULT_STEPS if steps is None else steps
    sde_indices = DEFAULT_SDE_INDICES if sde_indices is None else tuple(sde_indices)
    target = sde_indices if target is None else target
    guidance = DEFAULT_GUIDANCE if guidance is None else guidance
    strategy = strategy or FlowGRPOSDE(eta=0.7)
    generator = torch.Generator().manual_seed(seed + 1000)
    segment = rollout(adapter, conditions, strategy, flow_sigmas(steps), sde_indices, latent_shape,
                      generator=generator, guidance=guidance, trajectory_dtype=trajectory_dtype, dense=dense)
    if config is None and batched:
        config = BATCHED
    return ReplayProblem(name, adapter, conditions, segment, strategy, tuple(target), guidance, config)
