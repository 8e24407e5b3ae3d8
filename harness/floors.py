"""A floor measured on stock code, with the minimum it never goes below.

Tolerances are multiples of a floor measured on the stock path (the same model at another batch shape, the
same formula in fp32 against fp64). That measurement can be exactly zero: a deterministic or batch-invariant
kernel on one CPU or GPU rounds identically at every shape, while the next runner does not. A bound of
``k x 0`` would then fail every correct fast path that differs by one rounding step on its host, and "too
loose" / "too tight" would lose their meaning. So every floor carries a stated minimum: a number of units in
the last place of the compared quantity's OWN magnitude (a log-prob's, a ratio's, a row's), and the floor a
policy uses is the larger of the two. Which one applied is recorded, so a report can say which checks ran at
their minimum on a host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["StockFloor", "eps"]


def eps(dtype: torch.dtype = torch.float32) -> float:
    """The spacing of ``dtype`` at 1.0 (one ulp of a value of magnitude 1)."""
    return float(torch.finfo(dtype).eps)


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

    def __post_init__(self) -> None:
        if self.ulps <= 0 or not math.isfinite(self.ulps):
            raise ValueError(f"a floor's minimum must be a positive number of ulps, got {self.ulps}")
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

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        where = f" ({self.source})" if self.source else ""
        return (f"floor {self.value:.2e} = max(measured {self.measured:.2e}{where}, {self.ulps:g} {dtype} ulps x "
                f"magnitude {self.magnitude:.3g} = {self.minimum:.2e})")

    def metrics(self) -> dict[str, Any]:
        """What a verdict records about its floor: the report and gpu-smoke read these keys."""
        return {"floor_measured": float(self.measured), "floor_minimum": float(self.minimum),
                "floor_minimum_ulps": float(self.ulps), "floor_at_minimum": self.at_minimum}
