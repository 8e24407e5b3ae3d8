"""Error growth over steps: how fast a per-step error curve grows, and how much faster than its stock floor
it may grow.

A bug that starts below a worst-element tolerance and compounds step by step looks like noise to a max|d|
check; the ratio of a curve's late steps to its early ones does not. Replay (over all T denoising steps)
and AR (over all decode steps) judge their curves with the same ratio and budget, through ``judge_growth``.

Both curves are floored point by point at the compared values' resolution (their fp32 spacing at each step's
magnitude) before any ratio is taken: below that, a difference is the values' own rounding, and a stock floor
that is exactly zero on some host (batch-invariant kernels) still has a defined growth. A floor that shrinks is
read as flat (growth 1), so the budget never drops below GROWTH_BUDGET x 1.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from harness.judging.compare import Verdict, noise_floor

__all__ = ["GROWTH_BUDGET", "GROWTH_K_MAX", "GROWTH_K_MIN", "HEADLINE", "MIN_GROWTH_STEPS", "first_departure",
           "growth_ratio", "judge_growth"]

# The fast path's error may grow at most GROWTH_BUDGET x as fast as the stock path's own per-step floor grows;
# a budget outside [GROWTH_K_MIN, GROWTH_K_MAX] x the floor's growth fails the check ("too loose"/"too tight").
GROWTH_BUDGET = 2.0
GROWTH_K_MIN, GROWTH_K_MAX = 1.5, 4.0
# The slowest floor growth a budget is read against: a flat curve (a floor that shrinks is read as flat).
FLAT_GROWTH = 1.0
MIN_GROWTH_STEPS = 6  # thirds of at least two steps each
# a growth verdict's headline: the error curve's growth ratio (mean of its last third over its first third), which
# a correct fast path reads equal to the stock floor's (margin 1 / GROWTH_BUDGET when the two curves coincide)
HEADLINE = "error_growth"


def growth_ratio(curve: torch.Tensor) -> float:
    """Mean of the last third of a curve over the mean of its first third; inf if any point is not finite."""
    if not bool(torch.isfinite(curve).all()):
        return math.inf
    third = max(1, curve.numel() // 3)
    early, late = float(curve[:third].mean()), float(curve[-third:].mean())
    return late / early if early > 0 else (0.0 if late == 0 else math.inf)


def _rounded(curve: torch.Tensor) -> list[float]:
    return [float(f"{float(point):.4g}") for point in curve]


def first_departure(error: torch.Tensor, floor: torch.Tensor, budget: float) -> str:
    """Where a growing error shows itself: the first step whose error exceeds ``budget`` x that step's floor."""
    above = (~(error <= budget * floor)).nonzero().flatten().tolist()
    if not above:
        return f"no single step exceeds {budget:g} x its floor: the error grows across the steps"
    step = above[0]
    return (f"the error first exceeds {budget:g} x the stock floor at step {step} of {error.numel()} "
            f"({float(error[step]):.2e} vs floor {float(floor[step]):.2e}; {len(above)} step(s) above it)")


def judge_growth(error: torch.Tensor, floor: torch.Tensor, resolution: torch.Tensor, *,
                 control: str, budget: float = GROWTH_BUDGET) -> Verdict:
    """The growth of ``error`` (per-step |fast - stock|) may be at most ``budget`` x the growth of ``floor``
    (the same measure on a stock-only control that runs the fast path's shapes, described by ``control``),
    both curves floored at ``resolution`` (per step, > 0). The budget must lie within
    [GROWTH_K_MIN, GROWTH_K_MAX] x the floor's growth as read (at least FLAT_GROWTH)."""
    curves = {"error": error, "floor": floor, "resolution": resolution}
    shapes = {name: tuple(curve.shape) for name, curve in curves.items()}
    if len(set(shapes.values())) != 1 or error.dim() != 1:
        raise ValueError(f"growth curves must be 1-D and of one length, got {shapes}")
    steps = int(error.numel())
    if steps < MIN_GROWTH_STEPS:
        raise ValueError(f"an error-growth check needs >= {MIN_GROWTH_STEPS} steps, got {steps}")
    resolution = resolution.double()
    error = torch.maximum(error.double(), resolution)
    floor = torch.maximum(floor.double(), resolution)
    grows, floor_grows = growth_ratio(error), growth_ratio(floor)
    read = max(floor_grows, FLAT_GROWTH)
    valid = math.isfinite(read)
    at_resolution = int((floor <= resolution).sum())
    policy = noise_floor(read if valid else math.inf, k=budget, reason=(
        f"per-step error growth (mean of the last third / mean of the first third of {steps} steps) at most "
        f"{budget:g} x the stock floor's growth {floor_grows:.3f} (read as >= {FLAT_GROWTH:g}); floor curve = "
        f"{control}, {float(floor.min()):.1e}..{float(floor.max()):.1e}; every point of both curves >= the "
        f"values' fp32 resolution ({at_resolution} of {steps} floor points sit at it)"))
    judged = policy.judge(torch.tensor([grows], dtype=torch.float64), torch.zeros(1, dtype=torch.float64),
                          what="error growth")
    # the policy judged one ratio: its elementwise metrics (max_abs of one number, a "mismatch" count) are not
    # what was measured, so the verdict's headline is the growth ratio itself
    verdict = dataclasses.replace(judged, headline=HEADLINE, metrics={
        k: v for k, v in judged.metrics.items() if k not in ("max_abs", "mismatched", "total", "rel_l2")})
    if not verdict.passed:  # a scalar has no "worst element": say at which step the error leaves its floor
        verdict = dataclasses.replace(verdict, message=(
            f"error growth {grows:.3g} exceeds {budget:g} x the stock floor's growth {read:.3g} = {policy.bound:.3g}"
            f"; {first_departure(error, floor, budget)}"))
    verdict = verdict.with_metrics(error_curve=_rounded(error), floor_curve=_rounded(floor),
                                   error_growth=grows, floor_growth=floor_grows, floor_measured=floor_grows,
                                   floor_minimum=FLAT_GROWTH, floor_at_minimum=floor_grows < FLAT_GROWTH,
                                   floor_points_at_resolution=at_resolution)
    finite = bool(torch.isfinite(floor).all()) and bool((resolution > 0).all())
    verdict = verdict.require(finite, f"stock per-step floor finite on all {steps} steps, each point floored at a "
                                      "positive resolution")
    return verdict.require_bounded(policy.bound, read, k_min=GROWTH_K_MIN, k_max=GROWTH_K_MAX, what="growth budget")
