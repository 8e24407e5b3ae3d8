"""Replay parity: run stock and fast on one problem, judge them, prove the fast path ran.

These functions take any adapter and any policy, so the CPU catalogue calls them with fakes and
tiny random-init models and the GPU tier with real checkpoints and dtype-specific policies. The fast
call goes through ``harness.plugins.conformance.resolve("replay", replay_batched)``: with
``--impl replay=MODULE:CALLABLE`` a team's own ``replay_batched(adapter, conditions, segment, ...)``
is judged instead, and the spies on the transformer still prove one batched forward ran.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from harness.judging.compare import Policy, Verdict, exact, holds
from harness.plugins import conformance
from harness.replay import diagnosis, policies
from harness.replay.controls import QUANTITIES
from harness.replay.denoiser import FUSED_COND_FIRST, UNCOND_FIRST
from harness.replay.problem import ReplayProblem
from harness.replay.replay import replay_batched, replay_serial
from harness.replay.segment import ReplayResult
from harness.replay.spy import spy_forwards

__all__ = [
    "Forwards",
    "ReplayRun",
    "compare_replay",
    "compare_replay_determinism",
    "declared_output_dtype",
    "fast_replay",
    "judge_result",
    "require_fast_path",
    "run_batched",
    "run_both",
    "run_serial",
    "with_row_layout",
]


@dataclass(frozen=True, eq=False)
class ReplayRun:
    serial: ReplayResult
    batched: ReplayResult | None
    serial_forwards: Forwards
    batched_forwards: Forwards


def fast_replay():
    """The batched replay under test: the suite's ``replay_batched`` or the ``--impl replay=...`` callable."""
    return conformance.resolve("replay", replay_batched)


class Forwards(tuple[int, ...]):
    """The batch size of every forward a run made, carrying the row-aligned inputs each was handed (``row_inputs``:
    what ``harness.replay.diagnosis`` traces a failing batched forward's rows with)."""

    row_inputs: tuple[dict[str, torch.Tensor], ...] = ()

    @classmethod
    def of(cls, spy: Any) -> Forwards:
        made = cls(spy.batch_sizes)
        made.row_inputs = tuple(spy.row_inputs)
        return made


def run_serial(problem: ReplayProblem) -> tuple[ReplayResult, Forwards]:
    with spy_forwards(problem.adapter.module) as spy:
        result = replay_serial(*problem.args())
    return result, Forwards.of(spy)


def run_batched(problem: ReplayProblem) -> tuple[ReplayResult | None, Forwards]:
    fast = fast_replay()
    with spy_forwards(problem.adapter.module) as spy:
        result = fast(*problem.args())
    return result, Forwards.of(spy)


def run_both(problem: ReplayProblem) -> ReplayRun:
    serial, serial_forwards = run_serial(problem)
    batched, batched_forwards = run_batched(problem)
    return ReplayRun(serial, batched, serial_forwards, batched_forwards)


def require_fast_path(verdict: Verdict, problem: ReplayProblem, batched_forwards: Sequence[int],
                      serial_forwards: Sequence[int] | None = None) -> Verdict:
    """AND in the spies: one forward of S*cfg*B rows for batched, S of cfg*B for serial."""
    want = [problem.batched_rows]
    verdict = verdict.require_ran(list(batched_forwards) == want,
                                  f"batched replay ran exactly one transformer forward of S*cfg*B = {want[0]} rows",
                                  batched_forwards=list(batched_forwards))
    if serial_forwards is not None:
        want_serial = [problem.serial_rows] * problem.steps
        fact = f"serial replay ran S = {problem.steps} forwards of cfg*B = {problem.serial_rows} rows"
        verdict = verdict.require(list(serial_forwards) == want_serial, fact,
                                  serial_forwards=list(serial_forwards))
    return verdict


def declared_output_dtype(what: str, returned: torch.dtype, trajectory: torch.dtype | None) -> torch.dtype | None:
    """The dtype ``what`` is judged in when the implementation under test declares it returns it in the trajectory
    dtype and did (``harness.plugins.declarations.ReplayDeclaration``); None otherwise."""
    declared = conformance.declaration("replay")
    quantity = what.split()[0]
    if declared is None or quantity not in QUANTITIES or declared.output_dtype(quantity) != "trajectory":
        return None
    return returned if trajectory is not None and returned == trajectory else None


def judge_result(policy: Policy, actual: torch.Tensor, expected: torch.Tensor,
                 target: Sequence[int], what: str, trajectory: torch.dtype | None = None) -> Verdict:
    """Judge ``[B, S, ...]`` tensors over every row and step; a shape mismatch is a failed fact. Outputs an
    implementation returns in the trajectory dtype (``trajectory``) by its declared convention are judged against the
    stock values rounded the same way (``policies.rounded_to``), and the row's headline names that dtype."""
    if actual.shape != expected.shape:
        return holds(False, f"{what} has the serial shape {list(expected.shape)}",
                     actual_shape=str(list(actual.shape)), expected_shape=str(list(expected.shape)))
    if actual.dtype != expected.dtype:
        rounded = declared_output_dtype(what, actual.dtype, trajectory)
        if rounded is None:
            quantity = what.split()[0]
            return holds(False, f"{what} comes back in {expected.dtype}, as the stock path returns it",
                         returned_dtype=str(actual.dtype), hint=(
                             f"an implementation that returns {quantity} in the trajectory dtype declares it: "
                             f"ReplayDeclaration({'log_probs' if quantity == 'log_probs' else 'means'}_dtype="
                             "'trajectory')"))
        verdict = _judged_in(rounded, policy, actual, expected, target, what)
    else:
        verdict = policy.judge(actual, expected, dims=("row", "step"), labels={"step": list(target)}, what=what)
    verdict = verdict.require(verdict.metrics.get("total") == expected.numel(), "every row and step compared")
    if not verdict.passed:  # which target steps went wrong, in target order: one bug hits one step, another all
        diff = (actual.double() - expected.double()).abs().transpose(0, 1).reshape(len(target), -1)
        worst = diff.nan_to_num(nan=float("inf")).amax(dim=1).tolist()
        verdict = verdict.with_metrics(max_abs_per_step=", ".join(f"step {step}: {d:.3e}"
                                                                  for step, d in zip(target, worst, strict=True)))
    return verdict


def _judged_in(dtype: torch.dtype, policy: Policy, actual: torch.Tensor, expected: torch.Tensor,
               target: Sequence[int], what: str) -> Verdict:
    """``policy`` in ``dtype``: stock rounded to it, a local-scale bound widened by one of its ulps per element; the
    headline metric carries the dtype's name."""
    verdict = policies.rounded_to(policy, dtype).judge(actual, expected.to(dtype), dims=("row", "step"),
                                                       labels={"step": list(target)}, what=f"{what} in {dtype}")
    name = str(dtype).removeprefix("torch.")
    if verdict.headline and verdict.headline in verdict.metrics:
        headline = f"{verdict.headline}_in_{name}"
        verdict = dataclasses.replace(verdict, headline=headline,
                                      metrics={**verdict.metrics, headline: verdict.metrics[verdict.headline]})
    return verdict.with_metrics(output_dtype=f"{name} (declared: the trajectory dtype)")


def compare_replay(problem: ReplayProblem, policy: Policy, what: str = "log_probs") -> Verdict:
    """Batched ``what`` (log_probs or prev_sample_means) against serial, with both spies."""
    if what not in QUANTITIES:
        raise ValueError(f"what must be one of {QUANTITIES}, got {what!r}")
    run = run_both(problem)
    if run.batched is None:
        return holds(False, "batched replay returned a result (no silent fallback)",
                     batched_forwards=str(list(run.batched_forwards)))
    verdict = judge_result(policy, getattr(run.batched, what), getattr(run.serial, what),
                           problem.target, what, problem.segment.dtype)
    return require_fast_path(with_row_layout(verdict, problem, run), problem, run.batched_forwards,
                             run.serial_forwards)


def with_row_layout(verdict: Verdict, problem: ReplayProblem, run: ReplayRun) -> Verdict:
    """A failing verdict headed by how the batched forward's rows are laid out, when that names the bug (a tiling
    nested the wrong way hands the model every stock row, in another order)."""
    if verdict.passed or len(run.batched_forwards.row_inputs) != 1:
        return verdict
    layout = problem.adapter.cfg_layout if problem.conditions.cfg_factor == 2 or problem.conditions.negative else ""
    branches = {FUSED_COND_FIRST: ("cond", "uncond"), UNCOND_FIRST: ("uncond", "cond")}.get(layout, ("cond",))
    found = diagnosis.row_layout(run.serial_forwards.row_inputs, run.batched_forwards.row_inputs[0], problem.target,
                                 branches, problem.segment.batch)
    if found is None:
        return verdict
    return dataclasses.replace(verdict, message=f"{found}\n{verdict.message}".strip()).with_metrics(row_layout=found)


def compare_replay_determinism(problem: ReplayProblem) -> Verdict:
    """The batched replay run twice on the same segment: exp(logp_2 - logp_1) == 1 exactly, and the
    transition means bitwise equal. A replay that re-samples instead of scoring the stored latent, or
    carries state between calls, breaks it. (The on-policy ratio against the rollout's recorded
    log-probs is a separate check.)"""
    first, first_forwards = run_batched(problem)
    second, _ = run_batched(problem)
    if first is None or second is None:
        return holds(False, "batched replay returned a result on both runs (no silent fallback)")
    ratio = torch.exp(second.log_probs - first.log_probs)
    verdict = judge_result(exact(), ratio, torch.ones_like(ratio), problem.target, "ratio run2/run1")
    verdict = verdict.merge(judge_result(exact(), second.prev_sample_means, first.prev_sample_means,
                                         problem.target, "prev_sample_means run2 vs run1"))
    return require_fast_path(verdict, problem, first_forwards)
