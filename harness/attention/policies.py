"""Tolerance policies of the attention kernels, each built from a control measured on stock code.

fp32: max|d| within k x masked SDPA's own fp32-vs-fp64 error on the same capture (``floor_policy``).
Low precision (bf16): per query row, within k x the worst error that stock masked SDPA run in that
dtype makes against the fp64 truth, relative to the row's own magnitude (``RowScaledFloor``). A
bound taken over the whole output is blind where outputs are small: image rows that see thousands
of keys are ~10x smaller than the first text rows, so a missed key there hid under the text rows'
rounding. Every bound is a multiple of its measured floor within [K_MIN, K_MAX]; a bound outside
fails the check as too loose or too tight (``Verdict.require_bounded``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from harness.attention.capture import Capture
from harness.attention.reference import expand_kv
from harness.judging.compare import UNSTAMPED, NoiseFloor, Policy, Verdict, locate, max_abs_diff, noise_floor, rel_l2
from harness.judging.floors import StockFloor, reduction_ceiling_ulps

__all__ = [
    "BF16_K",
    "FP32_K",
    "K_MAX",
    "K_MIN",
    "FloorControl",
    "RowControl",
    "RowScaledFloor",
    "bound_and_floor",
    "bounded",
    "floor_control",
    "floor_policy",
    "in_dtype",
    "low_precision_policy",
    "reference_output",
    "rel_l2_bound",
    "row_control",
]

# A kernel exactly as accurate as the reference differs from it by up to 2 x the floor (both lie within
# the floor of the truth), so a bound under 2 x fails correct kernels; above 16 x a bound stops being
# about rounding (a kernel 15 x less accurate than stock is a bug of its own).
K_MIN = 2.0
K_MAX = 16.0
FP32_K = 4.0  # room for a kernel up to 3 x less accurate than the reference (another reduction order)
BF16_K = 4.0  # the same room, per row, against stock bf16 masked SDPA's own relative error


def reference_output(capture: Capture, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Masked SDPA of the capture under its own mask, (B, H, Q, D), optionally in another dtype.

    torch's SDPA is called here directly, not through ``harness.attention.primitives``: the kernels under test
    launch through those, so a bug there moves a kernel's output and never the reference it is judged against."""
    q, k, v = capture.heads_first()
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    k, v = expand_kv(k, capture.heads), expand_kv(v, capture.heads)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=capture.mask, scale=capture.scale)


def in_dtype(capture: Capture, dtype: torch.dtype) -> Capture:
    """The capture with q/k/v cast to ``dtype`` (what a low-precision run feeds the kernel)."""
    return dataclasses.replace(capture, query=capture.query.to(dtype), key=capture.key.to(dtype),
                               value=capture.value.to(dtype), name=f"{capture.name} ({str(dtype).split('.')[-1]})")


# ----------------------------------------------------------------------------------------------- fp32


# Every attention floor's stated minimum: one ulp of the reference's dtype at the compared quantity's own magnitude
# (the output's max |value| for max|d|, 1 for a relative error). A kernel and its reference can agree bitwise.
FLOOR_ULPS = 1.0


@dataclass(frozen=True)
class FloorControl:
    """The reference's own error against an fp64 ground truth: the noise floor of its dtype.

    ``scale`` is the truth's max |value|, the magnitude the max|d| floor's minimum is counted in.
    """

    max_abs: float
    rel_l2: float
    dtype: str
    scale: float = 0.0
    terms: int = 0  # reduction terms one output accumulates (attention_terms); 0: no ceiling stated

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype.removeprefix("torch."))

    def max_abs_floor(self) -> StockFloor:
        """The max|d| floor, at least FLOOR_ULPS ulps of the output's magnitude."""
        return StockFloor(self.max_abs, self.scale, FLOOR_ULPS, self.torch_dtype,
                          source=f"masked SDPA {self.dtype} vs fp64", **_ceiling(self.terms))

    def rel_l2_floor(self) -> StockFloor:
        """The relative-L2 floor, at least FLOOR_ULPS ulps of a relative quantity (magnitude 1)."""
        return StockFloor(self.rel_l2, 1.0, FLOOR_ULPS, self.torch_dtype,
                          source=f"masked SDPA {self.dtype} vs fp64, relative L2", **_ceiling(self.terms))


ATTENTION_TERMS = "the head dim (q.k) plus twice the keys (the softmax's sum, the weighted sum of values)"


def _ceiling(terms: int) -> dict[str, Any]:
    """A StockFloor's ceiling arguments for an attention output of ``terms`` reduction terms (none when 0)."""
    if not terms:
        return {}
    return {"ceiling_ulps": reduction_ceiling_ulps(terms), "ceiling_reason": f"K = {terms}: {ATTENTION_TERMS}",
            "control": "dtype"}


def attention_terms(capture: Capture) -> int:
    """The rounded terms one attention output accumulates: D for a score, KV for the softmax's normaliser and KV for
    the weighted sum of values (chained, so they add)."""
    return int(capture.query.shape[-1]) + 2 * int(capture.key.shape[1])


def floor_control(capture: Capture, reference: torch.Tensor | None = None) -> FloorControl:
    ref = reference_output(capture) if reference is None else reference
    truth = reference_output(capture, torch.float64)
    return FloorControl(max_abs_diff(ref, truth), rel_l2(ref, truth), str(ref.dtype),  # both compare in fp64
                        float(truth.abs().max()), attention_terms(capture))  # a Capture is never empty


def floor_policy(control: FloorControl, k: float = FP32_K) -> NoiseFloor:
    """max|d| within k x the reference's own error against fp64 on the same capture (at least its minimum).

    One missed key at S ~ 5k moves outputs by ~1e-4, two orders of magnitude above the fp32 floor
    (~1e-7 .. 5e-7 measured), so k = 4 leaves rounding room without hiding a mask bug.
    """
    floor = control.max_abs_floor()
    return noise_floor(floor.value, k, metric="max_abs", reason=f"k x {floor.describe()} on the same capture")


def rel_l2_bound(control: FloorControl, k: float = FP32_K) -> float:
    """The relative-L2 twin of ``floor_policy``: k x the reference's own relative L2 vs fp64 (at least its
    minimum)."""
    return k * control.rel_l2_floor().value


# ------------------------------------------------------------------------------------- low precision


def _row_error_and_scale(actual: torch.Tensor, truth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row (B, H, Q): max |a - t| over the head dim, and the row's magnitude max |t|."""
    a, t = actual.detach().double(), truth.detach().double()
    return (a - t).abs().amax(dim=-1), t.abs().amax(dim=-1)


@dataclass(frozen=True)
class RowControl:
    """Stock masked SDPA in ``dtype`` against the fp64 truth: its worst error per row / the row's magnitude."""

    relative: float
    worst_row: str
    dtype: str
    terms: int = 0  # reduction terms one output accumulates (attention_terms); 0: no ceiling stated

    def floor(self) -> StockFloor:
        """The relative floor, at least FLOOR_ULPS ulps of ``dtype`` (a relative quantity: magnitude 1)."""
        return StockFloor(self.relative, 1.0, FLOOR_ULPS, getattr(torch, self.dtype.removeprefix("torch.")),
                          source=f"{self.dtype} masked SDPA vs fp64, worst row {self.worst_row}",
                          **_ceiling(self.terms))

    @property
    def relative_floor(self) -> float:
        """The relative floor a bound multiplies: the measurement, or its minimum where it showed less."""
        return self.floor().value


def row_control(capture: Capture, dtype: torch.dtype, truth: torch.Tensor | None = None) -> RowControl:
    """Measure the low-precision floor on stock code: masked SDPA in ``dtype`` vs masked SDPA in fp64."""
    truth = reference_output(capture, torch.float64) if truth is None else truth
    stock = reference_output(in_dtype(capture, dtype))
    error, scale = _row_error_and_scale(stock, truth)
    if not bool(torch.isfinite(error).all()):
        raise ValueError(f"stock masked SDPA in {dtype} is not finite on {capture.name}: no floor to measure")
    ratio = error / scale.clamp_min(torch.finfo(torch.float64).tiny)
    at = int(ratio.reshape(-1).argmax())
    return RowControl(float(ratio.reshape(-1)[at]), locate(at, ratio.shape, ("batch", "head", "query row")),
                      str(dtype), attention_terms(capture))


@dataclass(frozen=True)
class RowScaledFloor(Policy):
    """Every query row: max|a - t| <= k x control.relative x max|t| of that row.

    ``expected`` is the high-precision truth (fp32/fp64 reference); the row's magnitude comes from it,
    so a row whose outputs are small gets a small bound.
    """

    control: RowControl
    k: float = BF16_K
    reason: str = ""

    def describe(self) -> str:
        text = (f"row_scaled(max|d| per query row <= {self.k:g} x {self.control.relative_floor:.3e} x the row's "
                f"max|ref|, "
                f"control: {self.control.dtype} masked SDPA vs fp64)")
        return f"{text} [{self.reason}]" if self.reason else text

    def judge(self, actual, expected, *, dims=None, labels=None, what="output") -> Verdict:
        if actual.shape != expected.shape:
            raise ValueError(f"shape mismatch: actual {tuple(actual.shape)} vs expected {tuple(expected.shape)}")
        error, scale = _row_error_and_scale(actual, expected)
        bound = self.k * self.control.relative_floor * scale
        finite = bool(torch.isfinite(actual).all()) and bool(torch.isfinite(expected).all())
        metrics = {"max_abs": max_abs_diff(actual, expected), "rel_l2": rel_l2(actual, expected),
                   "relative_control": self.control.relative, "control_row": self.control.worst_row, "k": self.k}
        if not finite:  # the headline counts them: a ratio of inf says nothing of how many rows went NaN
            bad = ~torch.isfinite(actual)
            rows = int(bad.reshape(*bad.shape[:-1], -1).any(dim=-1).sum()) if bad.dim() else int(bad)
            metrics.update(nonfinite=int(bad.sum()), nonfinite_rows=rows,
                           nonfinite_expected=int((~torch.isfinite(expected)).sum()))
            return Verdict(UNSTAMPED, False, metrics, self.describe(), math.inf, headline="nonfinite",
                           tolerance=1.0, message=f"{what}: {int(bad.sum())} non-finite output values in {rows} query "
                                                  f"rows ({metrics['nonfinite_expected']} in the reference); NaN/Inf "
                                                  "never pass")
        ratio = torch.where(bound > 0, error / bound, torch.where(error > 0, math.inf, 0.0))
        at = int(ratio.reshape(-1).argmax()) if ratio.numel() else 0
        margin = float(ratio.reshape(-1)[at]) if ratio.numel() else 0.0
        where = locate(at, ratio.shape, dims, labels) if ratio.numel() else "none"
        metrics.update(row_ratio=margin, worst_row=where,
                       worst_row_error=float(error.reshape(-1)[at]) if ratio.numel() else 0.0,
                       worst_row_scale=float(scale.reshape(-1)[at]) if ratio.numel() else 0.0)
        passed = margin <= 1.0
        message = "" if passed else (
            f"{what}: {int((ratio > 1).sum())} / {ratio.numel()} query rows beyond the row bound; worst at {where}: "
            f"max|d| {metrics['worst_row_error']:.3e} > {self.k:g} x {self.control.relative_floor:.3e} x row max|ref| "
            f"{metrics['worst_row_scale']:.3e}")
        return Verdict(UNSTAMPED, passed, metrics, self.describe(), margin, headline="row_ratio", tolerance=1.0,
                       message=message)


def low_precision_policy(capture: Capture, dtype: torch.dtype, truth: torch.Tensor | None = None,
                         k: float = BF16_K) -> RowScaledFloor:
    """The low-precision kernel policy on ``capture``: control measured on stock masked SDPA in ``dtype``."""
    control = row_control(capture, dtype, truth)
    return RowScaledFloor(control, k, reason=f"{dtype} masked SDPA vs fp64 on {capture.name}, worst row "
                                             f"{control.worst_row}")


# ------------------------------------------------------------------------------------ two-sided bounds


def bound_and_floor(policy: Policy, floor: float | StockFloor | None) -> tuple[float, float | StockFloor] | None:
    """(the policy's bound, the measured floor it is a multiple of), or None when it cannot be told.

    A noise-floor policy's bound is compared with ``floor`` (measured by the caller on stock code);
    a row-scaled policy carries its own: k x the relative control against the relative control.
    """
    if isinstance(policy, RowScaledFloor):
        return policy.k * policy.control.relative_floor, policy.control.floor()
    if isinstance(policy, NoiseFloor) and floor is not None:
        return policy.bound, floor if isinstance(floor, StockFloor) else float(floor)
    return None


def bounded(verdict: Verdict, policy: Policy, floor: float | StockFloor | None) -> Verdict:
    """Require the policy's bound within [K_MIN, K_MAX] x its measured floor ("too loose" / "too tight")."""
    pair = bound_and_floor(policy, floor)
    if pair is None:
        return verdict.require(False, f"tolerance of {policy.describe()} is too loose: it is not a multiple of a "
                                      "floor measured on stock code")
    bound, measured = pair
    value = measured.value if isinstance(measured, StockFloor) else measured
    return verdict.require_bounded(bound, measured, k_min=K_MIN, k_max=K_MAX).with_metrics(
        bound_floor_multiple=bound / value if value > 0 else math.inf)
