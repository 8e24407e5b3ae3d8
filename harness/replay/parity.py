"""Replay parity: run stock and fast on one problem, judge them, prove the fast path ran.

These functions take any adapter and any policy, so the CPU catalogue calls them with fakes and
tiny random-init models and the GPU tier with real checkpoints and dtype-specific policies.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.compare import Close, Policy, Verdict, close, exact, expect, max_abs_diff
from harness.replay.conditions import Conditions, Payload
from harness.replay.denoiser import DenoiserAdapter, Guidance
from harness.replay.guards import ReplayConfig
from harness.replay.replay import replay_batched, replay_serial
from harness.replay.sde import SDEStrategy
from harness.replay.segment import ReplayResult, TrajectorySegment
from harness.replay.spy import spy_forwards

__all__ = [
    "InflatedBatch",
    "ReplayProblem",
    "ReplayRun",
    "batch_shape_floor",
    "compare_pi_old_ratio",
    "compare_replay",
    "floor_policy",
    "judge_result",
    "run_both",
]

QUANTITIES = ("log_probs", "prev_sample_means")


@dataclass(frozen=True, eq=False)
class ReplayProblem:
    """Everything one replay call needs; the batched flag is on (a check wants the fast path)."""

    name: str
    adapter: DenoiserAdapter
    conditions: Conditions
    segment: TrajectorySegment
    strategy: SDEStrategy
    target: tuple[int, ...]
    guidance: Guidance = 1.0
    config: ReplayConfig = field(default_factory=lambda: ReplayConfig(batch_replay_steps=True))

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

    def with_(self, **changes: Any) -> ReplayProblem:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, eq=False)
class ReplayRun:
    serial: ReplayResult
    batched: ReplayResult | None
    serial_forwards: tuple[int, ...]
    batched_forwards: tuple[int, ...]


def _args(problem: ReplayProblem) -> tuple[Any, ...]:
    return (problem.adapter, problem.conditions, problem.segment, problem.strategy, problem.target,
            problem.guidance, problem.config)


def run_serial(problem: ReplayProblem) -> tuple[ReplayResult, tuple[int, ...]]:
    with spy_forwards(problem.adapter.module) as spy:
        result = replay_serial(*_args(problem))
    return result, tuple(spy.batch_sizes)


def run_batched(problem: ReplayProblem) -> tuple[ReplayResult | None, tuple[int, ...]]:
    with spy_forwards(problem.adapter.module) as spy:
        result = replay_batched(*_args(problem))
    return result, tuple(spy.batch_sizes)


def run_both(problem: ReplayProblem) -> ReplayRun:
    serial, serial_forwards = run_serial(problem)
    batched, batched_forwards = run_batched(problem)
    return ReplayRun(serial, batched, serial_forwards, batched_forwards)


def require_fast_path(verdict: Verdict, problem: ReplayProblem, batched_forwards: Sequence[int],
                      serial_forwards: Sequence[int] | None = None) -> Verdict:
    """AND in the spies: one forward of S*cfg*B rows for batched, S of cfg*B for serial."""
    want = [problem.batched_rows]
    verdict = verdict.require(list(batched_forwards) == want,
                              f"batched replay ran exactly one transformer forward of S*cfg*B = {want[0]} rows",
                              batched_forwards=list(batched_forwards))
    if serial_forwards is not None:
        want_serial = [problem.serial_rows] * problem.steps
        fact = f"serial replay ran S = {problem.steps} forwards of cfg*B = {problem.serial_rows} rows"
        verdict = verdict.require(list(serial_forwards) == want_serial, fact,
                                  serial_forwards=list(serial_forwards))
    return verdict


def judge_result(policy: Policy, check_id: str, actual: torch.Tensor, expected: torch.Tensor,
                 target: Sequence[int], what: str) -> Verdict:
    """Judge ``[B, S, ...]`` tensors over every row and step; a shape mismatch is a failed fact."""
    if actual.shape != expected.shape:
        return expect(check_id, False, f"{what} has the serial shape {list(expected.shape)}",
                      actual_shape=str(list(actual.shape)), expected_shape=str(list(expected.shape)))
    verdict = policy.judge(check_id, actual, expected, dims=("row", "step"), labels={"step": list(target)},
                           what=what)
    return verdict.require(verdict.metrics.get("total") == expected.numel(), "every row and step compared")


def compare_replay(problem: ReplayProblem, policy: Policy, check_id: str, what: str = "log_probs") -> Verdict:
    """Batched ``what`` (log_probs or prev_sample_means) against serial, with both spies."""
    if what not in QUANTITIES:
        raise ValueError(f"what must be one of {QUANTITIES}, got {what!r}")
    run = run_both(problem)
    if run.batched is None:
        return expect(check_id, False, "batched replay returned a result (no silent fallback)",
                      batched_forwards=str(list(run.batched_forwards)))
    verdict = judge_result(policy, check_id, getattr(run.batched, what), getattr(run.serial, what),
                           problem.target, what)
    return require_fast_path(verdict, problem, run.batched_forwards, run.serial_forwards)


def compare_pi_old_ratio(problem: ReplayProblem, anchor_policy: Policy, check_id: str) -> Verdict:
    """pi_old replayed through the batched path: ratio exp(new - old) == 1 exactly, and the anchor
    agrees with the log-probs the rollout recorded (under ``anchor_policy``)."""
    anchor, anchor_forwards = run_batched(problem)
    new, _ = run_batched(problem)
    if anchor is None or new is None:
        return expect(check_id, False, "batched replay returned a result for the pi_old anchor")
    ratio = torch.exp(new.log_probs - anchor.log_probs)
    verdict = judge_result(exact(), check_id, ratio, torch.ones_like(ratio), problem.target, "ratio new/old")
    recorded = problem.segment.recorded_log_probs(problem.target)
    verdict = verdict.merge(judge_result(anchor_policy, check_id, anchor.log_probs, recorded, problem.target,
                                         "anchor log_probs vs rollout"))
    return require_fast_path(verdict, problem, anchor_forwards)


# --------------------------------------------------------------------------------- batch-shape floor


def _replicate(value: Payload, factor: int) -> Payload:
    if isinstance(value, torch.Tensor):
        return torch.cat([value] * factor)
    return value * factor


class InflatedBatch(DenoiserAdapter):
    """The stock forward with its N rows replicated ``factor`` times, keeping the first N outputs.

    It changes nothing but the batch shape, so serial replay through it against serial replay
    through ``inner`` measures the batch-shape rounding floor of the model.
    """

    def __init__(self, inner: DenoiserAdapter, factor: int):
        if factor < 1:
            raise ValueError(f"factor must be >= 1, got {factor}")
        self.inner, self.factor = inner, factor
        self.cfg_layout = inner.cfg_layout
        self.module = inner.module

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        return self.inner.timestep(sigma)

    def forward(self, hidden: torch.Tensor, timestep: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        rows = hidden.shape[0]
        grown = Conditions(batch=conditions.batch * self.factor,
                           rows={k: _replicate(v, self.factor) for k, v in conditions.rows.items()},
                           shared=conditions.shared, cfg_factor=conditions.cfg_factor)
        out = self.inner.forward(_replicate(hidden, self.factor), _replicate(timestep, self.factor), grown)
        return out[:rows]


def batch_shape_floor(problem: ReplayProblem, factor: int | None = None) -> dict[str, float]:
    """max |serial at B rows - serial with the same rows inside a factor x larger batch|, per quantity.

    ``factor`` defaults to S, the batch growth the fast path brings.
    """
    base = replay_serial(*_args(problem))
    grown = replay_serial(*_args(problem.with_(adapter=InflatedBatch(problem.adapter, factor or problem.steps))))
    return {what: max_abs_diff(getattr(grown, what), getattr(base, what)) for what in QUANTITIES}


def floor_policy(floor: float, *, multiple: float, minimum: float, what: str, dtype: str = "fp32") -> Close:
    """close(atol = max(multiple x floor, minimum), rtol=0) with the measured floor in its reason."""
    if not math.isfinite(floor) or floor < 0:
        raise ValueError(f"a batch-shape floor must be finite and >= 0, got {floor}")
    atol = max(multiple * floor, minimum)
    return close(atol=atol, rtol=0.0,
                 reason=f"{dtype} batch-shape rounding: {what} floor {floor:.2e} measured (serial at B rows vs "
                        f"the same rows in an S*B batch); atol = max({multiple:g} x floor, {minimum:g})")
