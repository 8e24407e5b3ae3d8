"""A floor measured on stock code, with the minimum it never goes below.

Tolerances are multiples of a floor measured on the stock path (the same model at another batch shape, the
same formula in fp32 against fp64). That measurement can be exactly zero: a deterministic or batch-invariant
kernel on one CPU or GPU rounds identically at every shape, while the next runner does not. A bound of
``k x 0`` would then fail every correct fast path that differs by one rounding step on its host, and "too
loose" / "too tight" would lose their meaning. So every floor carries a stated minimum: a number of units in
the last place of the compared quantity's OWN magnitude (a log-prob's, a ratio's, a row's), and the floor a
policy uses is the larger of the two. Which one applied is recorded, so a report can say which checks ran at
their minimum on a host.

A floor also has a CEILING, stated from the arithmetic before anything runs: the most that rounding alone can
make two orderings of the same computation differ. A control that runs stock code at the fast path's shapes
(the family adapter at S x B rows, the model with other rows beside a prompt) measures rounding only while the
stock path computes the same function at both shapes; if it does not (a row field expanded with ``repeat``, a
batch statistic, routing that reads the other rows), the "floor" is a bug's size, and multiplying it would hide
that very bug. So a measured floor above its ceiling is not a floor: the verdict fails, saying the stock path
itself depends on the batch composition. The ceiling is ``CEILING_C x sqrt(K) x eps(dtype) x magnitude`` for K
the reduction terms one output accumulates (``reduction_ceiling_ulps``; each site states its K): rounding
errors of a sum of K terms behave as a random walk of K steps of at most half an ulp each, so their spread
grows as sqrt(K), and CEILING_C standard deviations on each of the two sides being compared are never reached
by rounding in practice, while every bug this suite has met moves a value by orders of magnitude more.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CEILING_C", "StockFloor", "declare", "eps", "module_reduction_terms", "reduction_ceiling_ulps",
           "stated_for"]

# standard deviations of a K-step rounding random walk, on each of the two sides compared (module docstring)
CEILING_C = 8.0


def eps(dtype: torch.dtype = torch.float32) -> float:
    """The spacing of ``dtype`` at 1.0 (one ulp of a value of magnitude 1)."""
    return float(torch.finfo(dtype).eps)


def reduction_ceiling_ulps(terms: int) -> float:
    """The ceiling of a floor over a computation whose outputs each accumulate ``terms`` rounded terms, in ulps
    of the compared magnitude: CEILING_C x sqrt(terms) (module docstring), never below one ulp."""
    if terms < 1:
        raise ValueError(f"a reduction has at least one term, got {terms}")
    return CEILING_C * math.sqrt(terms)


def module_reduction_terms(module: Any, sequence: int = 0) -> int:
    """How many rounded terms one output of ``module`` accumulates, counted from its structure: the fan-in of every
    Linear and Conv layer (one multiply-add chain each; parallel branches are counted as if chained, which only
    raises the ceiling) plus ``sequence`` for each attention over that many keys the caller knows of."""
    terms = 0
    for layer in module.modules():
        weight = getattr(layer, "weight", None)
        if isinstance(layer, torch.nn.Linear):
            terms += layer.in_features
        elif isinstance(layer, torch.nn.modules.conv._ConvNd) and isinstance(weight, torch.Tensor):
            terms += int(weight[0].numel())
    return max(1, terms + sequence)


@dataclass(frozen=True)
class StockFloor:
    """``measured`` on stock code, never below ``ulps`` ulps of ``dtype`` at ``magnitude``.

    ``magnitude`` is the compared quantity's own scale (1.0 for a ratio that should be 1, or for an error
    already relative to its local magnitude); ``source`` says what was measured, in the path's words.
    """

    measured: float
    magnitude: float
    ulps: float
    dtype: torch.dtype = torch.float32
    source: str = ""
    ceiling_ulps: float = math.inf  # the arithmetic's ceiling in ulps of ``magnitude`` (reduction_ceiling_ulps)
    ceiling_reason: str = ""  # what K is and why
    control: str = "batch"  # what the control varies: "batch" (stock code at another shape) or "dtype" (vs fp64)

    def __post_init__(self) -> None:
        if self.ulps <= 0 or not math.isfinite(self.ulps):
            raise ValueError(f"a floor's minimum must be a positive number of ulps, got {self.ulps}")
        if not self.ceiling_ulps >= self.ulps:
            raise ValueError(f"a floor's ceiling ({self.ceiling_ulps} ulps) must lie at or above its minimum "
                             f"({self.ulps} ulps)")
        if math.isfinite(self.ceiling_ulps) and not self.ceiling_reason.strip():
            raise ValueError("a floor's ceiling states what it is derived from (ceiling_reason)")
        if self.control not in ("batch", "dtype"):
            raise ValueError(f"a floor's control varies the batch or the dtype, got {self.control!r}")
        if self.measured < 0 or self.magnitude < 0:
            raise ValueError(f"a floor is an error size (>= 0), got measured {self.measured}, "
                             f"magnitude {self.magnitude}")

    @property
    def minimum(self) -> float:
        """``ulps`` x the dtype's spacing at ``magnitude``: the resolution of the values being compared."""
        return self.ulps * eps(self.dtype) * self.magnitude

    @property
    def value(self) -> float:
        """The floor a policy multiplies: the measurement, or the minimum where the stock run showed less.

        A non-finite measurement stays non-finite: a stock run that produced NaN has no floor to offer.
        """
        if not math.isfinite(self.measured):
            return self.measured
        return max(self.measured, self.minimum)

    @property
    def at_minimum(self) -> bool:
        """True when the minimum, not the measurement, set the floor (a zero floor on this host, say)."""
        return math.isfinite(self.measured) and self.measured < self.minimum

    @property
    def ceiling(self) -> float:
        """The most rounding alone can measure here: ``ceiling_ulps`` x the dtype's spacing at ``magnitude``."""
        if not math.isfinite(self.ceiling_ulps):
            return math.inf
        return self.ceiling_ulps * eps(self.dtype) * self.magnitude

    @property
    def above_ceiling(self) -> bool:
        """True when the measurement is not rounding: above the ceiling, or not finite."""
        return not self.measured <= self.ceiling

    def ceiling_fact(self) -> str:
        """The fact a verdict requires of its floor, worded for whichever way it went."""
        why = f" ({self.ceiling_reason})" if self.ceiling_reason else ""
        where = f" on {self.source}" if self.source else ""
        if self.above_ceiling:
            dtype = str(self.dtype).removeprefix("torch.")
            cause = ("the stock path itself depends on the batch composition (or on what shares its forward)"
                     if self.control == "batch" else
                     f"the stock computation in {dtype} loses more than rounding (a bug or a cancellation in it)")
            return (f"{cause}: its floor measured {self.measured:.3e}{where} is above the ceiling rounding allows, "
                    f"{self.ceiling:.3e} = {self.ceiling_ulps:.3g} ulps x magnitude {self.magnitude:.3g}{why}")
        return f"the stock floor is rounding: measured {self.measured:.2e} <= its ceiling {self.ceiling:.2e}{why}"

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        where = f" ({self.source})" if self.source else ""
        ceiling = f"; ceiling {self.ceiling:.2e} = {self.ceiling_ulps:.3g} ulps" if math.isfinite(self.ceiling) else ""
        return (f"floor {self.value:.2e} = max(measured {self.measured:.2e}{where}, {self.ulps:g} {dtype} ulps x "
                f"magnitude {self.magnitude:.3g} = {self.minimum:.2e}){ceiling}")

    def metrics(self) -> dict[str, Any]:
        """What a verdict records about its floor: the report and gpu-smoke read these keys."""
        stated = {"floor_ceiling": float(self.ceiling), "floor_ceiling_ulps": float(self.ceiling_ulps)} \
            if math.isfinite(self.ceiling_ulps) else {}
        return {"floor_measured": float(self.measured), "floor_minimum": float(self.minimum),
                "floor_minimum_ulps": float(self.ulps), "floor_at_minimum": self.at_minimum, **stated}


# check-id pattern -> the floor its policy stands on, stated before anything runs (--parity-list prints it)
_STATED: dict[str, str] = {}


def declare(pattern: str, minimum: str, ceiling: str) -> None:
    """State the floor of the checks whose ids match ``pattern``: its minimum and its ceiling, in words a
    reviewer can check against the arithmetic (the measured values land in the report)."""
    if not minimum.strip() or not ceiling.strip():
        raise ValueError(f"a floor declared for {pattern!r} states both its minimum and its ceiling")
    _STATED[pattern] = f"minimum {minimum}; ceiling {ceiling}"


def stated_for(check_id: str) -> str:
    """The declared floor of ``check_id`` (the most specific matching pattern, the longest), or ""."""
    matches = [p for p in _STATED if fnmatch.fnmatchcase(check_id, p)]
    return _STATED[max(matches, key=len)] if matches else ""
