"""How replay results are judged: exact on the fake kernel, local-scale bounds on real models.

A real model's batched replay differs from serial only by the rounding its kernels bring at another
batch shape. The bound comes from the STOCK control (harness.replay.controls): the largest deviation
it shows RELATIVE to the local magnitude of the quantity (per row for log-probs, per row and step for
transition means), floored at the resolution of the fp32 SDE math. The allowed error of an element is then
``k x that relative floor x its own local magnitude``, so a bound never borrows the size of the
largest values of the output. ``k`` is bounded on both sides: at least K_MIN (the fast path's rows
land at other positions of the batch than the control's) and at most K_MAX (looser would stop
seeing real bugs); a policy outside that band fails its check as mis-set.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from harness.judging.compare import UNSTAMPED, Policy, Verdict, exact, locate
from harness.judging.floors import StockFloor, eps, reduction_ceiling_ulps
from harness.replay.controls import BatchShapeControl

__all__ = [
    "BF16_K",
    "FP32_K",
    "K_MAX",
    "K_MIN",
    "MODEL_DTYPES",
    "RESOLUTION",
    "RESOLUTION_ULPS",
    "LocalScaleBound",
    "exact",
    "k_for",
    "local_scale",
    "local_scale_policy",
    "relative_floor",
    "rounded_to",
    "ulp_of",
]

K_MIN, K_MAX = 2.0, 8.0
FP32_K = 4.0  # fp32: 4 x the relative floor (the CPU tier's tiny models are often batch-shape exact)
BF16_K = 2.0  # bf16: 2 x the relative floor; its GEMMs round differently at every batch shape
# The smallest relative floor a policy uses: 4 fp32 ulps, the resolution of the SDE math (always fp32).
# The model dtype's rounding enters through the measured control, not through a fixed step: a bf16 ulp
# of a log-prob (which is dominated by its -log std term) would hide the velocity errors under it.
FP32_EPS = float(torch.finfo(torch.float32).eps)
RESOLUTION_ULPS = 4.0
RESOLUTION = RESOLUTION_ULPS * FP32_EPS
MODEL_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# leading dims that keep their own scale: log_probs [B, S] per row; means [B, S, *latent] per (row, step)
LOCAL_DIMS = {"log_probs": 1, "prev_sample_means": 2}


def local_scale(values: torch.Tensor, what: str) -> torch.Tensor:
    """max |values| over the non-local dims of ``what``, broadcastable to ``values`` (fp64)."""
    if what not in LOCAL_DIMS:
        raise ValueError(f"no local scale is defined for {what!r}; expected one of {sorted(LOCAL_DIMS)}")
    keep = LOCAL_DIMS[what]
    magnitude = values.detach().double().abs()
    reduce = tuple(range(keep, magnitude.dim()))
    return magnitude.amax(dim=reduce, keepdim=True) if reduce else magnitude


def relative_floor(control: BatchShapeControl, what: str) -> float:
    """The control's largest deviation relative to the local magnitude of the stock values."""
    scale = local_scale(control.base_values(what), what)
    deviation = control.deviation(what)
    ratio = torch.where(scale > 0, deviation / scale, torch.where(deviation > 0, math.inf, 0.0))
    return float(ratio.max()) if ratio.numel() else 0.0


@dataclass(frozen=True)
class LocalScaleBound(Policy):
    """|actual - expected| <= k x max(relative_floor, resolution) x local_scale(expected), elementwise."""

    what: str
    relative_floor: float
    resolution: float
    k: float
    dtype: str = "fp32"
    terms: int = 0  # reduction terms one replayed value accumulates (controls.replay_terms); 0: no ceiling
    rounded_to: torch.dtype | None = None  # the output dtype both sides are rounded to (a declared convention)

    @property
    def effective_floor(self) -> float:
        """The measured relative floor, or the fp32 resolution where the control showed less."""
        return max(self.relative_floor, self.resolution)

    @property
    def stock_floor(self) -> StockFloor:
        """The relative floor with its minimum: ``resolution`` is RESOLUTION_ULPS fp32 ulps of a relative
        quantity (magnitude 1); the control may measure exactly zero on a batch-invariant host."""
        # the model's rounding is its dtype's: the ceiling counts model-dtype ulps, written in fp32 ulps
        model_ulp = eps({"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.dtype, torch.float32)) / FP32_EPS
        ceiling = ({"ceiling_ulps": max(reduction_ceiling_ulps(self.terms) * model_ulp, self.resolution / FP32_EPS),
                    "ceiling_reason": f"K = {self.terms}: the denoiser's Linear/Conv fan-ins and the latent's "
                                      f"elements, in {self.dtype} ulps of the local magnitude"} if self.terms else {})
        return StockFloor(self.relative_floor, 1.0, self.resolution / FP32_EPS,
                          source="stock serial at B rows vs at the fast path's shape, relative to the local magnitude",
                          **ceiling)

    @property
    def relative_bound(self) -> float:
        return self.k * self.effective_floor

    def describe(self) -> str:
        rounded = (f" + 1 {self.rounded_to} ulp of each element, judged in {self.rounded_to} with stock rounded the "
                   "same way (the implementation's declared output dtype: two values within the bound round at "
                   "most one ulp apart)" if self.rounded_to is not None else "")
        return (f"local_scale({self.dtype} {self.what}: |d| <= {self.k:g} x max(floor {self.relative_floor:.2e}, "
                f"resolution {self.resolution:.2e}) x local |{self.what}|{rounded}; floor = stock serial at B rows vs "
                f"at the fast path's S x cfg x B-row shape, relative to the local magnitude)")

    def judge(self, actual, expected, *, dims=None, labels=None, what="output") -> Verdict:
        if actual.shape != expected.shape:
            raise ValueError(f"{what}: shapes {tuple(actual.shape)} and {tuple(expected.shape)} differ")
        if self.rounded_to is not None:
            expected = expected.to(self.rounded_to)
        a, b = actual.detach().double(), expected.detach().double()
        diff = (a - b).abs()
        scale = local_scale(b, self.what).expand_as(b)
        allowed = self.relative_bound * scale
        if self.rounded_to is not None:
            allowed = allowed + ulp_of(b, self.rounded_to)
        finite = bool(torch.isfinite(a).all() and torch.isfinite(b).all() and math.isfinite(self.relative_floor))
        if not finite:
            ratio, margin, relative_error = diff, math.inf, math.inf
        elif diff.numel() == 0:
            ratio, margin, relative_error = diff, 0.0, 0.0
        else:
            ratio = torch.where(allowed > 0, diff / allowed, torch.where(diff > 0, math.inf, 0.0))
            margin = float(ratio.max())
            relative_error = margin * self.relative_bound  # max |d| / local magnitude
        metrics = {"max_abs": float(diff.max()) if diff.numel() else 0.0, "total": actual.numel(),
                   "nonfinite": int((~torch.isfinite(a)).sum() + (~torch.isfinite(b)).sum()),
                   "max_relative_to_local": relative_error, "relative_floor": self.relative_floor,
                   "resolution": self.resolution, "relative_bound": self.relative_bound, "k": self.k}
        passed = finite and margin <= 1.0
        message = ""
        if not finite:
            message = f"{what}: non-finite values or floor; NaN/Inf never pass"
        elif not passed:
            at = int(torch.nan_to_num(ratio, nan=math.inf).reshape(-1).argmax())
            bad = int((ratio > 1).sum())
            message = (f"{what}: {bad} / {actual.numel()} elements beyond the local bound; worst at "
                       f"{locate(at, actual.shape, dims, labels)}: |d| {float(diff.reshape(-1)[at]):.3e} "
                       f"(up to {float(allowed.reshape(-1)[at]):.3e} allowed = {self.relative_bound:.2e} x local "
                       f"|{self.what}| {float(scale.reshape(-1)[at]):.3e})")
        verdict = Verdict(UNSTAMPED, passed, metrics, self.describe(), margin, headline="max_relative_to_local",
                          tolerance=self.relative_bound, message=message)
        return verdict.require_bounded(self.relative_bound, self.stock_floor, k_min=K_MIN, k_max=K_MAX,
                                       what=f"relative {self.what} bound")


def ulp_of(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at each of ``values`` (fp64): ``eps x 2^(e - 1)`` for a value in ``[2^(e-1), 2^e)``;
    at zero, the spacing of the smallest normal."""
    info = torch.finfo(dtype)
    magnitude = torch.maximum(values.detach().double().abs(), torch.tensor(info.tiny, dtype=torch.float64))
    _, exponent = torch.frexp(magnitude)
    return info.eps * torch.pow(2.0, (exponent - 1).double())


def rounded_to(policy: Policy, dtype: torch.dtype) -> Policy:
    """``policy`` for outputs an implementation returns in ``dtype`` by its declared convention: the stock side
    rounded the same way, and a local-scale bound widened by one ``dtype`` ulp of each element (two values within
    the bound round at most one ulp apart). Exact stays exact: bitwise equal fp32 values round alike."""
    if isinstance(policy, LocalScaleBound):
        return dataclasses.replace(policy, rounded_to=dtype)
    return policy


def k_for(dtype: torch.dtype) -> float:
    """k for a model running in ``dtype``: FP32_K for fp32, BF16_K for both 16-bit dtypes."""
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"no replay policy for model dtype {dtype}; expected one of "
                         f"{sorted(str(d) for d in MODEL_DTYPES)}")
    return FP32_K if dtype == torch.float32 else BF16_K


def local_scale_policy(control: BatchShapeControl, what: str, dtype: torch.dtype) -> LocalScaleBound:
    """The policy for ``what`` when the model runs in ``dtype``, from a stock batch-shape control."""
    k = k_for(dtype)
    return LocalScaleBound(what, relative_floor(control, what), RESOLUTION, k, MODEL_DTYPES[dtype], control.terms)
