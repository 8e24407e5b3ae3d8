"""Error growth over steps: how fast a per-step error curve grows, and how much faster than its stock floor
it may grow.

A bug that starts below a worst-element tolerance and compounds step by step looks like noise to a max|d|
check; the ratio of a curve's late steps to its early ones does not. Replay (over all T denoising steps)
and AR (over all decode steps) judge their curves with the same ratio and budget.
"""

from __future__ import annotations

import math

import torch

__all__ = ["GROWTH_BUDGET", "GROWTH_K_MAX", "GROWTH_K_MIN", "growth_ratio"]

# The fast path's error may grow at most GROWTH_BUDGET x as fast as the stock path's own per-step floor grows;
# a budget outside [GROWTH_K_MIN, GROWTH_K_MAX] x the floor's growth fails the check ("too loose"/"too tight").
GROWTH_BUDGET = 2.0
GROWTH_K_MIN, GROWTH_K_MAX = 1.5, 4.0


def growth_ratio(curve: torch.Tensor) -> float:
    """Mean of the last third of a curve over the mean of its first third; inf if any point is not finite."""
    if not bool(torch.isfinite(curve).all()):
        return math.inf
    third = max(1, curve.numel() // 3)
    early, late = float(curve[:third].mean()), float(curve[-third:].mean())
    return late / early if early > 0 else (0.0 if late == 0 else math.inf)
