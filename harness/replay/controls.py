"""The batch-shape control: what the STOCK path alone changes when its rows sit in a bigger batch.

Serial replay at B rows against serial replay with the same rows replicated S times inside each
forward (``InflatedBatch``): nothing but the batch shape differs, so the difference is the rounding
the model's kernels bring at the fast path's batch size. Policies are built from it; a control that
ran the fast path could absorb the very bug it should expose, so none does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.replay.conditions import Conditions, Payload
from harness.replay.denoiser import DenoiserAdapter, WrappedAdapter
from harness.replay.problem import ReplayProblem
from harness.replay.replay import replay_serial
from harness.replay.segment import ReplayResult

__all__ = ["QUANTITIES", "BatchShapeControl", "InflatedBatch", "measure_batch_shape_control"]

QUANTITIES = ("log_probs", "prev_sample_means")


def _replicate(value: Payload, factor: int) -> Payload:
    if isinstance(value, torch.Tensor):
        return torch.cat([value] * factor)
    return value * factor


class InflatedBatch(WrappedAdapter):
    """The stock forward with its N rows replicated ``factor`` times, keeping the first N outputs.

    It receives row fields already broadcast to N rows and replicates them block-wise with the
    latents, so the inner adapter sees a consistent ``factor * N``-row forward.
    """

    def __init__(self, inner: DenoiserAdapter, factor: int):
        if factor < 1:
            raise ValueError(f"factor must be >= 1, got {factor}")
        super().__init__(inner)
        self.factor = factor

    def forward(self, hidden: torch.Tensor, timestep: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        rows = hidden.shape[0]
        grown = Conditions(batch=conditions.batch * self.factor,
                           rows={k: _replicate(v, self.factor) for k, v in conditions.rows.items()},
                           shared=conditions.shared, cfg_factor=conditions.cfg_factor)
        out = self.inner.forward(_replicate(hidden, self.factor), _replicate(timestep, self.factor), grown)
        return out[:rows]


@dataclass(frozen=True, eq=False)
class BatchShapeControl:
    """Stock serial replay at B rows (``base``) and with its rows inside a ``factor`` x larger batch."""

    base: ReplayResult
    grown: ReplayResult
    factor: int

    def deviation(self, what: str) -> torch.Tensor:
        """Elementwise |grown - base| of ``what`` (fp64)."""
        if what not in QUANTITIES:
            raise ValueError(f"what must be one of {QUANTITIES}, got {what!r}")
        return (getattr(self.grown, what).double() - getattr(self.base, what).double()).abs()

    def base_values(self, what: str) -> torch.Tensor:
        """The stock values of ``what`` at B rows."""
        return getattr(self.base, what)

    def max_deviation(self, what: str) -> float:
        return float(self.deviation(what).max())


def measure_batch_shape_control(problem: ReplayProblem, factor: int | None = None) -> BatchShapeControl:
    """Run the control; ``factor`` defaults to S, the batch growth the fast path brings."""
    base = replay_serial(*problem.args())
    inflated = problem.with_(adapter=InflatedBatch(problem.adapter, factor or problem.steps))
    return BatchShapeControl(base, replay_serial(*inflated.args()), factor or problem.steps)
