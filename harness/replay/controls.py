"""The batch-shape control: what the STOCK path alone changes when its rows run at the fast path's shape.

Serial replay at B rows against serial replay whose every forward runs inside a batch of the fast path's
shape (``FastShapeAdapter``): S x cfg x B rows, branch-major outside and step-major inside, with the rows of
the k-th target at the very block the fast path gives target k. Nothing but the batch shape differs (the
same GEMM M, the same row positions), so the difference is the rounding the model's kernels bring at the
fast path's batch shape, and it may be exactly zero on a batch-invariant host. Policies are built from it; a
control that ran the fast path could absorb the very bug it should expose, so none does: the rows are
spread here, independently of ``harness.replay.tiling``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.judging.floors import module_reduction_terms
from harness.replay.conditions import Conditions, Payload, concat_payloads, payload_rows, slice_rows
from harness.replay.denoiser import DenoiserAdapter, WrappedAdapter
from harness.replay.problem import ReplayProblem
from harness.replay.replay import replay_serial
from harness.replay.segment import ReplayResult

__all__ = ["QUANTITIES", "BatchShapeControl", "FastShapeAdapter", "fast_shape_serial", "measure_batch_shape_control"]

QUANTITIES = ("log_probs", "prev_sample_means")


def _spread(value: Payload, groups: int, steps: int) -> Payload:
    """``[g_0; g_1; ...]`` (``groups`` equal row groups) -> ``[g_0 x steps; g_1 x steps; ...]``."""
    per = payload_rows(value) // groups
    blocks = [slice_rows(value, g * per, (g + 1) * per) for g in range(groups) for _ in range(steps)]
    return concat_payloads(blocks)


class FastShapeAdapter(WrappedAdapter):
    """The stock forward of N = cfg x B rows run inside a forward of ``steps`` x N rows laid out as the fast
    path lays out its batch, keeping the N outputs at the block of the current step.

    The serial loop calls ``forward`` once per target, in target order, so call k stands for target k, whose
    rows the fast path puts at block k of each CFG branch. The other blocks hold copies of the same rows: row
    contents differ from the fast path's, the shape and positions do not. Use one instance per serial replay.
    """

    def __init__(self, inner: DenoiserAdapter, steps: int):
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        super().__init__(inner)
        self.steps = steps
        self.calls = 0

    def forward(self, hidden: torch.Tensor, timestep: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        rows, groups = hidden.shape[0], conditions.cfg_factor
        if groups < 1 or rows % groups:
            raise ValueError(f"a forward of {rows} rows does not split into {groups} CFG branches")
        block, per = self.calls % self.steps, rows // groups
        self.calls += 1
        grown = Conditions(batch=conditions.batch * self.steps,
                           rows={k: _spread(v, groups, self.steps) for k, v in conditions.rows.items()},
                           shared=conditions.shared, cfg_factor=conditions.cfg_factor)
        out = self.inner.forward(_spread(hidden, groups, self.steps), _spread(timestep, groups, self.steps), grown)
        starts = [(g * self.steps + block) * per for g in range(groups)]
        return torch.cat([out[start: start + per] for start in starts])


@dataclass(frozen=True, eq=False)
class BatchShapeControl:
    """Stock serial replay at B rows (``base``) and with every forward at the fast path's shape (``grown``)."""

    base: ReplayResult
    grown: ReplayResult
    factor: int
    terms: int = 0  # reduction terms one replayed value accumulates (replay_terms); 0: no ceiling stated

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


def fast_shape_serial(problem: ReplayProblem, steps: int | None = None) -> ReplayResult:
    """Stock serial replay of ``problem`` with every forward at the fast path's shape for ``steps`` targets
    (default: the problem's S)."""
    adapter = FastShapeAdapter(problem.adapter, steps or problem.steps)
    return replay_serial(*problem.with_(adapter=adapter).args())


def replay_terms(problem: ReplayProblem) -> int:
    """The rounded terms one replayed value accumulates: every Linear and Conv fan-in of the denoiser (its forward)
    plus the latent's elements (the log-prob's mean over them)."""
    module = getattr(problem.adapter, "module", None)
    if not isinstance(module, torch.nn.Module):
        return 0  # nothing to count the forward's reductions from: no ceiling is stated
    return module_reduction_terms(module) + int(problem.segment.latents[0, 0].numel())


def measure_batch_shape_control(problem: ReplayProblem, factor: int | None = None) -> BatchShapeControl:
    """Run the control; ``factor`` defaults to S, the batch growth the fast path brings."""
    base = replay_serial(*problem.args())
    return BatchShapeControl(base, fast_shape_serial(problem, factor), factor or problem.steps, replay_terms(problem))
