"""Metrics and comparison policies that turn (actual, expected) into a `Verdict`.

Every policy judges ALL elements, reports where the worst difference sits in the path's own
words (``dims`` / ``labels``), and records ``margin = error / tolerance`` so a report can say how
close a pass was and how far an ablation overshot. Non-finite values never pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.testing._comparison import default_tolerances

from harness.judging.floors import StockFloor
from harness.paths import path_of

__all__ = [
    "UNSTAMPED",
    "Close",
    "Exact",
    "NoiseFloor",
    "Policy",
    "Ulp",
    "Verdict",
    "bit_patterns",
    "close",
    "exact",
    "holds",
    "locate",
    "max_abs_diff",
    "mismatched",
    "noise_floor",
    "raises",
    "rel_l2",
    "sha256",
    "ulp",
    "ulp_distance",
]


# --------------------------------------------------------------------------------------------- verdict

UNSTAMPED = ""  # the id of a verdict a judge returned before the check runner stamped the registered one


@dataclass(frozen=True)
class Verdict:
    """The outcome of one parity check.

    ``margin`` is error / tolerance (<= 1 passes for tolerance policies; 0 or inf for exact ones;
    None for boolean facts). ``headline`` names the metric a table shows first.
    """

    check_id: str
    passed: bool
    metrics: dict[str, Any]
    policy: str
    margin: float | None
    headline: str | None = None
    tolerance: float | None = None
    message: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    ran_facts: tuple[str, ...] = field(default_factory=tuple)  # the required facts that prove the fast path ran

    @property
    def path(self) -> str:
        return path_of(self.check_id)

    @property
    def headline_value(self) -> Any:
        return self.metrics.get(self.headline) if self.headline else None

    def require(self, ok: bool, fact: str, **metrics: Any) -> Verdict:
        """AND a boolean fact (a spy count, a batch size) into this verdict.

        Parity checks use it to prove the fast path ran: equal outputs from a silent fallback
        must not pass.
        """
        note = f"{'ok' if ok else 'VIOLATED'}: {fact}"
        message = self.message if ok else _join(self.message, f"required fact violated: {fact}")
        return dataclasses.replace(
            self,
            passed=self.passed and bool(ok),
            metrics={**self.metrics, **metrics},
            message=message,
            notes=(*self.notes, note),
        )

    def require_ran(self, ok: bool, fact: str, **metrics: Any) -> Verdict:
        """``require`` for a fact that proves the fast path ran (a spy's forward count, the collectives a sharded
        decode made): the guard contract of a declared-unsupported input accepts the stock answer without them."""
        verdict = self.require(ok, fact, **metrics)
        return dataclasses.replace(verdict, ran_facts=(*verdict.ran_facts, fact))

    def require_bounded(self, tolerance: float, floor: float | StockFloor, *, k_min: float, k_max: float,
                        what: str = "tolerance") -> Verdict:
        """The tolerance must sit within [k_min, k_max] x the floor measured on stock code.

        Below k_min the check would flag the stock path's own noise; above k_max it is "too loose" to
        catch a bug of the floor's size. Both the floor and the bound are recorded beside each other. A
        ``StockFloor`` brings its stated minimum (a measured floor may be exactly zero on some hosts) and
        records which of the two applied, so "too loose" keeps its meaning at a zero floor, and its stated
        ceiling: a floor measured above it fails the verdict (the stock path depends on the batch composition).
        """
        if isinstance(floor, StockFloor):
            verdict = self.with_metrics(**floor.metrics())
            if math.isfinite(floor.ceiling_ulps):  # a floor above its ceiling is a bug in the stock path, not noise
                verdict = verdict.require(not floor.above_ceiling, floor.ceiling_fact())
            return verdict.require_bounded(tolerance, floor.value, k_min=k_min, k_max=k_max, what=what)
        low, high = k_min * floor, k_max * floor
        if tolerance > high:
            fact = (f"{what} {_fmt(float(tolerance))} is too loose: above {k_max:g} x the stock floor "
                    f"{_fmt(float(floor))} = {_fmt(float(high))}")
        elif tolerance < low:
            fact = (f"{what} {_fmt(float(tolerance))} is too tight: below {k_min:g} x the stock floor "
                    f"{_fmt(float(floor))} = {_fmt(float(low))}")
        else:
            fact = f"{what} within [{k_min:g}, {k_max:g}] x the stock floor {_fmt(float(floor))}"
        return self.require(low <= tolerance <= high, fact, stock_floor=float(floor), tolerance_bound=float(tolerance))

    def with_metrics(self, **metrics: Any) -> Verdict:
        """Attach metrics (a measured floor, a spy's counts) without asserting anything."""
        return dataclasses.replace(self, metrics={**self.metrics, **metrics})

    @property
    def violated_facts(self) -> list[str]:
        """The required facts this verdict failed on (their text), in the order they were required."""
        return [note.split(": ", 1)[1] for note in self.notes if note.startswith("VIOLATED: ")]

    def merge(self, other: Verdict) -> Verdict:
        """Combine two verdicts on one check: both must pass; the larger margin is the headline."""
        mine, theirs = self.margin, other.margin
        use_other = theirs is not None and (mine is None or theirs > mine)
        lead = other if use_other else self
        metrics = {**self.metrics, **other.metrics}
        if lead.headline and lead.headline in lead.metrics:  # the headline stays the leading verdict's own number
            metrics[lead.headline] = lead.metrics[lead.headline]
        return Verdict(
            check_id=self.check_id,
            passed=self.passed and other.passed,
            metrics=metrics,
            policy=self.policy if self.policy == other.policy else f"{self.policy}; {other.policy}",
            margin=lead.margin,
            headline=lead.headline,
            tolerance=lead.tolerance,
            message=_join(self.message, other.message),
            notes=(*self.notes, *other.notes),
            ran_facts=(*self.ran_facts, *other.ran_facts),
        )

    def describe(self) -> str:
        status = "PASS" if self.passed else "FAIL"
        lines = [f"{status} {self.check_id} under {self.policy}"]
        if self.message:
            lines.append(self.message)
        shown = {k: v for k, v in self.metrics.items() if not isinstance(v, (list, dict))}
        if shown:
            lines.append("metrics: " + ", ".join(f"{k}={_fmt(v)}" for k, v in shown.items()))
        lines.extend(self.notes)
        if self.margin is not None:
            # a margin within tolerance on a failed verdict reads like a pass: say what failed it
            failed_on = self.violated_facts if not self.passed and self.margin <= 1 else []
            lines.append(f"margin (error / tolerance): {_fmt(self.margin)}"
                         + (f" (the numbers pass; fact failed: {'; '.join(failed_on)})" if failed_on else ""))
        return "\n".join(lines)


def _join(*parts: str) -> str:
    return "\n".join(p for p in parts if p)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value == 0 or math.isinf(value) or math.isnan(value):
            return repr(value)
        return f"{value:.3e}"
    return str(value)


# --------------------------------------------------------------------------------------------- metrics


def _same_shape(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if actual.shape != expected.shape:
        raise ValueError(f"shape mismatch: actual {tuple(actual.shape)} vs expected {tuple(expected.shape)}")


def max_abs_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - b| computed in float64; inf when either side holds a non-finite value."""
    _same_shape(actual, expected)
    if actual.numel() == 0:
        return 0.0
    a, b = actual.detach().double(), expected.detach().double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return math.inf
    return float((a - b).abs().max())


_ORDERED_INT = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def _ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """Map IEEE floats to integers whose order and spacing match the floats' (int64)."""
    int_dtype = _ORDERED_INT.get(x.dtype)
    if int_dtype is None:
        raise TypeError(f"ULP distance needs a float tensor of {sorted(map(str, _ORDERED_INT))}, got {x.dtype}")
    bits = x.view(int_dtype).to(torch.int64)  # a same-width integer view: any strides, never requires grad
    sign_min = -(2 ** (torch.iinfo(int_dtype).bits - 1))
    # sign-magnitude -> two's complement order: -0.0 maps onto +0.0, negatives count down from there
    return torch.where(bits < 0, sign_min - bits, bits)


def ulp_distance(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place of the (shared) dtype, as int64.

    +0.0 and -0.0 are 0 apart; the smallest subnormals either side of zero are 2 apart.
    """
    _same_shape(actual, expected)
    if actual.dtype != expected.dtype:
        raise TypeError(f"ULP distance needs one dtype, got {actual.dtype} vs {expected.dtype}")
    return (_ordered_bits(actual) - _ordered_bits(expected)).abs()


_SAME_WIDTH_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def bit_patterns(x: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as integers of the same width: -0.0 and +0.0 differ, NaN payloads count."""
    if x.dtype == torch.bool:
        return x.to(torch.uint8)
    if x.is_complex():
        x = torch.view_as_real(x)
    return x.view(_SAME_WIDTH_INT[x.element_size()])  # a same-width integer view: any strides, never requires grad


def mismatched(actual: torch.Tensor, expected: torch.Tensor) -> int:
    """Number of elements whose bit patterns differ (so -0.0 vs +0.0 and NaN payloads are mismatches)."""
    _same_shape(actual, expected)
    if actual.dtype != expected.dtype:
        return actual.numel()
    return int((bit_patterns(actual) != bit_patterns(expected)).sum())


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (inf if b is all zeros and a is not)."""
    _same_shape(actual, expected)
    a, b = actual.detach().double(), expected.detach().double()
    num, den = float(torch.linalg.vector_norm(a - b)), float(torch.linalg.vector_norm(b))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def sha256(tensor: torch.Tensor) -> str:
    """SHA-256 of the tensor's bytes (dtype and shape are part of what equal hashes promise)."""
    data = tensor.detach().cpu().contiguous()
    header = f"{data.dtype}:{tuple(data.shape)}:".encode()
    raw = data.view(torch.uint8).numpy().tobytes() if data.numel() else b""
    return hashlib.sha256(header + raw).hexdigest()


def nonfinite(tensor: torch.Tensor) -> int:
    if not tensor.is_floating_point():
        return 0
    return int((~torch.isfinite(tensor)).sum())


def locate(flat_index: int, shape: Sequence[int], dims: Sequence[str] | None = None,
           labels: Mapping[str, Sequence[Any]] | None = None) -> str:
    """Name an element in the path's own words: ``row 2, step 17, element (0, 3, 1)``.

    ``dims`` names the leading dimensions; ``labels`` maps a dim name to the value each index
    stands for (e.g. step index -> the target step number).
    """
    index = list(torch.unravel_index(torch.tensor(flat_index), tuple(shape))) if shape else []
    index = [int(i) for i in index]
    dims = list(dims or [])
    parts = []
    for name, i in zip(dims, index, strict=False):
        shown = labels[name][i] if labels and name in labels else i
        parts.append(f"{name} {shown}")
    rest = index[len(dims):]
    if rest:
        parts.append(f"element {tuple(rest)}")
    return ", ".join(parts) if parts else "scalar"


def _worst(score: torch.Tensor) -> int:
    """Flat index of the largest score; every caller passes a NaN-free score (non-finite inputs are reported
    before any location is looked up)."""
    return int(score.reshape(-1).argmax())


# --------------------------------------------------------------------------------------------- policies


class Policy:
    """A rule that judges actual against expected over every element."""

    def describe(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def judge(self, actual: torch.Tensor, expected: torch.Tensor, *,
              dims: Sequence[str] | None = None, labels: Mapping[str, Sequence[Any]] | None = None,
              what: str = "output") -> Verdict:  # pragma: no cover - abstract
        raise NotImplementedError

    def __str__(self) -> str:
        return self.describe()


def _base_metrics(actual: torch.Tensor, expected: torch.Tensor) -> dict[str, Any]:
    """max|d|, mismatches, rel L2 and non-finite count in one float64 pass (outputs can be large)."""
    _same_shape(actual, expected)
    total = actual.numel()
    a, b = actual.detach().double(), expected.detach().double()
    bad = int((~torch.isfinite(a)).sum()) + int((~torch.isfinite(b)).sum()) if total else 0
    diff = a - b
    if total == 0:
        max_abs, rel = 0.0, 0.0
    elif bad:
        max_abs, rel = math.inf, math.inf
    else:
        max_abs = float(diff.abs().max())
        num, den = float(torch.linalg.vector_norm(diff)), float(torch.linalg.vector_norm(b))
        rel = (0.0 if num == 0.0 else math.inf) if den == 0.0 else num / den
    return {
        "max_abs": max_abs,
        "mismatched": int((actual != expected).sum()),
        "total": total,
        "rel_l2": rel,
        "nonfinite": bad,
    }


def _nonfinite_message(actual: torch.Tensor, expected: torch.Tensor, what: str) -> str:
    return (f"{what}: non-finite values (actual {nonfinite(actual)}, expected {nonfinite(expected)}); "
            "NaN/Inf never pass")


@dataclass(frozen=True)
class Exact(Policy):
    """Bitwise equality (dtype and shape included)."""

    def describe(self) -> str:
        return "exact (bitwise)"

    def judge(self, actual, expected, *, dims=None, labels=None, what="output") -> Verdict:
        if actual.dtype != expected.dtype:
            return Verdict(UNSTAMPED, False, {"actual_dtype": str(actual.dtype), "expected_dtype": str(expected.dtype)},
                           self.describe(), math.inf, message=f"{what}: dtype {actual.dtype} vs {expected.dtype}")
        metrics = _base_metrics(actual, expected)
        metrics["mismatched"] = mismatched(actual, expected)  # bit patterns, not ==: -0.0 is not +0.0
        if actual.is_floating_point():
            dist = ulp_distance(actual, expected)
            metrics["max_ulp"] = int(dist.max()) if dist.numel() else 0
        bad = metrics["mismatched"]
        passed = bad == 0 and metrics["nonfinite"] == 0
        message = ""
        if metrics["nonfinite"]:
            message = _nonfinite_message(actual, expected, what)
        elif bad:
            differs = (bit_patterns(actual) != bit_patterns(expected)).double()
            if actual.is_floating_point():
                diff = (actual.double() - expected.double()).abs() + differs  # a sign-of-zero flip still shows
            else:
                diff = differs
            where = locate(_worst(diff), actual.shape, dims, labels)
            share = 100 * bad / max(1, metrics["total"])
            message = (f"{what}: mismatched elements: {bad} / {metrics['total']} ({share:.1f}%); "
                       f"greatest absolute difference {_fmt(metrics['max_abs'])} at {where} (0 allowed)")
        return Verdict(UNSTAMPED, passed, metrics, self.describe(), 0.0 if passed else math.inf,
                       headline="max_abs", tolerance=0.0, message=message)


@dataclass(frozen=True)
class Ulp(Policy):
    """At most ``n`` units in the last place apart, elementwise, in the tensors' own dtype."""

    n: int

    def describe(self) -> str:
        return f"ulp({self.n})"

    def judge(self, actual, expected, *, dims=None, labels=None, what="output") -> Verdict:
        metrics = _base_metrics(actual, expected)
        dist = ulp_distance(actual, expected)
        worst = int(dist.max()) if dist.numel() else 0
        metrics["max_ulp"] = worst
        finite = metrics["nonfinite"] == 0
        passed = finite and worst <= self.n
        margin = (worst / self.n if self.n else (0.0 if worst == 0 else math.inf)) if finite else math.inf
        message = ""
        if not finite:
            message = _nonfinite_message(actual, expected, what)
        elif not passed:
            message = (f"{what}: {int((dist > self.n).sum())} / {metrics['total']} elements beyond {self.n} ULP; "
                       f"greatest ULP distance {worst} at {locate(_worst(dist), actual.shape, dims, labels)} "
                       f"(up to {self.n} allowed)")
        return Verdict(UNSTAMPED, passed, metrics, self.describe(), margin, headline="max_ulp",
                       tolerance=float(self.n), message=message)


@dataclass(frozen=True)
class Close(Policy):
    """|a - b| <= atol + rtol * |b| elementwise (torch.testing semantics and defaults).

    ``reason`` says why these tolerances (dtype, measured batch-shape floor, ...).
    """

    atol: float | None = None
    rtol: float | None = None
    reason: str = ""

    def resolved(self, dtype: torch.dtype) -> tuple[float, float]:
        rtol, atol = default_tolerances(dtype)
        return (self.atol if self.atol is not None else atol, self.rtol if self.rtol is not None else rtol)

    def describe(self, dtype: torch.dtype | None = None) -> str:
        if dtype is None:
            atol = "default" if self.atol is None else f"{self.atol:g}"
            rtol = "default" if self.rtol is None else f"{self.rtol:g}"
        else:
            a, r = self.resolved(dtype)
            atol, rtol = f"{a:g}", f"{r:g}"
        text = f"close(atol={atol}, rtol={rtol})"
        return f"{text} [{self.reason}]" if self.reason else text

    def judge(self, actual, expected, *, dims=None, labels=None, what="output") -> Verdict:
        atol, rtol = self.resolved(actual.dtype if actual.dtype == expected.dtype else torch.float64)
        metrics = _base_metrics(actual, expected)
        metrics.update(atol=atol, rtol=rtol)
        a, b = actual.detach().double(), expected.detach().double()
        allowed = atol + rtol * b.abs()
        diff = (a - b).abs()
        finite = metrics["nonfinite"] == 0
        if not finite:
            ratio, margin = diff, math.inf
        elif diff.numel() == 0:
            ratio, margin = diff, 0.0
        else:
            ratio = torch.where(allowed > 0, diff / allowed, torch.where(diff > 0, math.inf, 0.0))
            margin = float(ratio.max())
        passed = finite and margin <= 1.0
        message = ""
        if not finite:
            message = _nonfinite_message(actual, expected, what)
        elif not passed:
            at = _worst(ratio)
            bad = int((ratio > 1).sum())
            message = (f"{what}: mismatched elements: {bad} / {metrics['total']} "
                       f"({100 * bad / max(1, metrics['total']):.1f}%); greatest absolute difference "
                       f"{_fmt(float(diff.reshape(-1)[at]))} at {locate(at, actual.shape, dims, labels)} "
                       f"(up to {_fmt(float(allowed.reshape(-1)[at]))} allowed)")
        return Verdict(UNSTAMPED, passed, metrics, self.describe(actual.dtype), margin, headline="max_abs",
                       tolerance=atol, message=message)


ErrorMetric = Callable[[torch.Tensor, torch.Tensor], float]


@dataclass(frozen=True)
class NoiseFloor(Policy):
    """error(actual, expected) <= k * control + floor.

    ``control`` is the same error metric measured on a pair that differs only benignly (a
    low-precision reference against ground truth, unpadded copies batched together).
    """

    control: float
    k: float
    floor: float
    metric: str = "max_abs"
    reason: str = ""

    @property
    def bound(self) -> float:
        return self.k * self.control + self.floor

    def describe(self) -> str:
        text = (f"noise_floor({self.metric} <= {self.k:g} x control {_fmt(float(self.control))} "
                f"+ floor {_fmt(float(self.floor))})")
        return f"{text} [{self.reason}]" if self.reason else text

    def judge(self, actual, expected, *, dims=None, labels=None, what="output") -> Verdict:
        metrics = _base_metrics(actual, expected)
        metrics.update(control=float(self.control), bound=self.bound)
        error = metrics[self.metric]
        finite = metrics["nonfinite"] == 0 and math.isfinite(self.control)
        bound = self.bound
        margin = (error / bound if bound > 0 else (0.0 if error == 0 else math.inf)) if finite else math.inf
        passed = finite and error <= bound
        message = ""
        if not finite:
            message = _nonfinite_message(actual, expected, what)
        elif not passed:
            diff = (actual.double() - expected.double()).abs()
            message = (f"{what}: {self.metric} {_fmt(error)} exceeds {self.k:g} x control {_fmt(float(self.control))} "
                       f"+ floor {_fmt(float(self.floor))} = {_fmt(bound)}; worst element at "
                       f"{locate(_worst(diff), actual.shape, dims, labels)}")
        return Verdict(UNSTAMPED, passed, metrics, self.describe(), margin, headline=self.metric,
                       tolerance=bound, message=message)


def exact() -> Exact:
    return Exact()


def ulp(n: int) -> Ulp:
    if n < 0:
        raise ValueError(f"ulp(n) needs n >= 0, got {n}")
    return Ulp(int(n))


def close(atol: float | None = None, rtol: float | None = None, *, reason: str = "") -> Close:
    for name, value in (("atol", atol), ("rtol", rtol)):
        if value is not None and (value < 0 or not math.isfinite(value)):
            raise ValueError(f"close() needs a finite {name} >= 0, got {value}")
    return Close(atol, rtol, reason)


def noise_floor(control: float | tuple[torch.Tensor, torch.Tensor], k: float = 2.0, floor: float = 0.0, *,
                metric: str = "max_abs", reason: str = "") -> NoiseFloor:
    """Build a noise-floor policy; ``control`` is an error value or a (control, reference) pair."""
    if isinstance(control, tuple):
        control = _base_metrics(*control)[metric]
    if k <= 0 or floor < 0:
        raise ValueError(f"noise_floor needs k > 0 and floor >= 0, got k={k}, floor={floor}")
    return NoiseFloor(float(control), float(k), float(floor), metric, reason)


# --------------------------------------------------------------------------------------------- facts


def holds(ok: bool, fact: str, **metrics: Any) -> Verdict:
    """A boolean check (a guard returned None, a tiled batch has S*cfg*B rows), filed under no id:
    the check runner stamps the registered one."""
    return Verdict(UNSTAMPED, bool(ok), dict(metrics), f"fact: {fact}", None,
                   message="" if ok else f"expected: {fact}; observed: "
                   + (", ".join(f"{k}={_fmt(v)}" for k, v in metrics.items()) or "it does not hold"),
                   notes=(f"{'ok' if ok else 'VIOLATED'}: {fact}",))


def raises(fn: Callable[[], Any], exc: type[BaseException] | tuple[type[BaseException], ...],
           match: str | None = None) -> Verdict:
    """The call must raise ``exc`` (and mention ``match``): bad input gets a clear error. Filed under no id."""
    import re

    names = exc.__name__ if isinstance(exc, type) else "/".join(e.__name__ for e in exc)
    fact = f"raises {names}" + (f" matching {match!r}" if match else "")
    try:
        fn()
    except exc as err:
        text = str(err)
        ok = match is None or re.search(match, text) is not None
        return holds(ok, fact, raised=type(err).__name__, error=text[:300])
    except Exception as err:  # noqa: BLE001 - the wrong exception type is a failed fact
        return holds(False, fact, raised=type(err).__name__, error=str(err)[:300])
    return holds(False, fact, raised="nothing")
