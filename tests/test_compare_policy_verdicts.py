"""Each policy's whole Verdict (metrics, margin, message, policy text) on tiny hand-built tensors.

Expected numbers are worked out by hand; ties sit exactly on the bound (they pass) and the next float above fails.
"""

import math
import struct

import pytest
import torch

from harness.compare import Verdict, close, exact, noise_floor, ulp

pytestmark = pytest.mark.cpu

NAN_MESSAGE = "output: non-finite values (actual {}, expected {}); NaN/Inf never pass"


def _f32_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


def _metrics(max_abs, mismatched, total, rel_l2, nonfinite=0, **extra):
    return {"max_abs": max_abs, "mismatched": mismatched, "total": total, "rel_l2": rel_l2, "nonfinite": nonfinite,
            **extra}


def test_exact_verdicts():
    expected = torch.tensor([[0.0, 0.0], [1.0, 4.0]])
    actual = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    assert exact().judge("t.x", actual, expected, dims=("row",), what="latents") == Verdict(
        "t.x", False, _metrics(2.0, 1, 4, pytest.approx(2 / math.sqrt(17), rel=1e-15),
                               max_ulp=_f32_bits(4.0) - _f32_bits(2.0)),
        "exact (bitwise)", math.inf, headline="max_abs", tolerance=0.0,
        message="latents: mismatched elements: 1 / 4 (25.0%); greatest absolute difference 2.000e+00 at row 1, "
                "element (1,) (0 allowed)")
    assert exact().judge("t.x", expected, expected.clone()) == Verdict(
        "t.x", True, _metrics(0.0, 0, 4, 0.0, max_ulp=0), "exact (bitwise)", 0.0, headline="max_abs", tolerance=0.0)
    several = exact().judge("t.x", torch.tensor([0.0, 1.0, 5.0]), torch.tensor([-0.0, 1.0, 1.0]))
    assert several.message == ("output: mismatched elements: 2 / 3 (66.7%); greatest absolute difference "
                               "4.000e+00 at element (2,) (0 allowed)")
    single = exact().judge("t.x", torch.tensor([1.0], dtype=torch.float64), torch.tensor([2.0], dtype=torch.float64))
    assert single == Verdict("t.x", False, _metrics(1.0, 1, 1, 0.5, max_ulp=0x4000000000000000 - 0x3FF0000000000000),
                             "exact (bitwise)", math.inf, headline="max_abs", tolerance=0.0,
                             message="output: mismatched elements: 1 / 1 (100.0%); greatest absolute difference "
                                     "1.000e+00 at element (0,) (0 allowed)")
    empty = torch.zeros(0, 3)
    assert exact().judge("t.x", empty, empty) == Verdict(
        "t.x", True, _metrics(0.0, 0, 0, 0.0, max_ulp=0), "exact (bitwise)", 0.0, headline="max_abs", tolerance=0.0)
    nan = exact().judge("t.x", torch.tensor([math.nan, 1.0]), torch.tensor([0.0, 1.0]))
    assert nan == Verdict("t.x", False, _metrics(math.inf, 1, 2, math.inf, 1, max_ulp=_f32_bits(math.nan)),
                          "exact (bitwise)", math.inf, headline="max_abs", tolerance=0.0,
                          message=NAN_MESSAGE.format(1, 0))
    mask = exact().judge("t.x", torch.tensor([True, False, True]), torch.tensor([True, True, True]), dims=("query",))
    assert mask == Verdict("t.x", False, _metrics(1.0, 1, 3, pytest.approx(1 / math.sqrt(3), rel=1e-15)),
                           "exact (bitwise)", math.inf, headline="max_abs", tolerance=0.0,
                           message="output: mismatched elements: 1 / 3 (33.3%); greatest absolute difference "
                                   "1.000e+00 at query 1 (0 allowed)")
    assert exact().judge("t.x", torch.zeros(2), torch.zeros(2, dtype=torch.float64), what="clips") == Verdict(
        "t.x", False, {"actual_dtype": "torch.float32", "expected_dtype": "torch.float64"}, "exact (bitwise)",
        math.inf, message="clips: dtype torch.float32 vs torch.float64")
    assert str(exact()) == "exact (bitwise)"


def test_ulp_verdicts():
    x = torch.tensor([1.0, -2.0, 0.0])
    y = x.clone()
    y[:1] = (x[:1].view(torch.int32) + 2).view(torch.float32)  # two float32 steps above 1.0
    two_steps = 2.0 * 2.0**-23
    metrics = _metrics(two_steps, 1, 3, pytest.approx(two_steps / math.sqrt(5), rel=1e-15), max_ulp=2)
    assert ulp(2).judge("t.u", y, x) == Verdict("t.u", True, metrics, "ulp(2)", 1.0, headline="max_ulp",
                                                tolerance=2.0)
    assert ulp(1).judge("t.u", y, x, dims=("row",)) == Verdict(
        "t.u", False, metrics, "ulp(1)", 2.0, headline="max_ulp", tolerance=1.0,
        message="output: 1 / 3 elements beyond 1 ULP; greatest ULP distance 2 at row 0 (up to 1 allowed)")
    assert ulp(0).judge("t.u", x, x.clone()).margin == 0.0 and ulp(0).judge("t.u", y, x).margin == math.inf
    assert ulp(0).judge("t.u", torch.zeros(0), torch.zeros(0)) == Verdict(
        "t.u", True, _metrics(0.0, 0, 0, 0.0, max_ulp=0), "ulp(0)", 0.0, headline="max_ulp", tolerance=0.0)
    bad = ulp(5).judge("t.u", torch.tensor([math.inf]), torch.tensor([1.0]))
    assert (bad.passed, bad.margin, bad.message) == (False, math.inf, NAN_MESSAGE.format(1, 0))


def test_close_verdicts():
    assert str(close()) == "close(atol=default, rtol=default)"
    assert close(1e-3, 0.02, reason="bf16 floor").describe() == "close(atol=0.001, rtol=0.02) [bf16 floor]"
    assert close().describe(torch.float32) == "close(atol=1e-05, rtol=1.3e-06)"
    zeros = torch.zeros(2, dtype=torch.float64)
    tie = torch.tensor([0.5, 0.0], dtype=torch.float64)
    assert close(atol=0.5, rtol=0).judge("t.c", tie, zeros) == Verdict(
        "t.c", True, _metrics(0.5, 1, 2, math.inf, atol=0.5, rtol=0.0), "close(atol=0.5, rtol=0)", 1.0,
        headline="max_abs", tolerance=0.5)
    above = torch.tensor([0.5, math.nextafter(0.5, 1.0)], dtype=torch.float64)  # one on the bound, one over
    over = close(atol=0.5, rtol=0).judge("t.c", above, zeros, dims=("row",))
    assert (over.passed, over.margin, over.message) == (
        False, math.nextafter(0.5, 1.0) / 0.5,
        "output: mismatched elements: 1 / 2 (50.0%); greatest absolute difference 5.000e-01 at row 1 "
        "(up to 5.000e-01 allowed)")
    # rtol scales |expected|: a negative reference still allows rtol * 10
    negative = close(atol=0, rtol=0.1).judge("t.c", torch.tensor([-10.5, 1.0], dtype=torch.float64),
                                             torch.tensor([-10.0, 1.0], dtype=torch.float64))
    assert (negative.passed, negative.margin) == (True, 0.5)
    below = close(atol=0.5, rtol=0).judge("t.c", torch.tensor([0.0, -1.0], dtype=torch.float64), zeros)
    assert (below.passed, below.margin) == (False, 2.0)
    strict = close(atol=0, rtol=0)
    assert strict.judge("t.c", torch.tensor([0.0, 2.0]), torch.tensor([0.0, 2.0])).margin == 0.0
    assert strict.judge("t.c", torch.tensor([0.5]), torch.tensor([0.0])).margin == math.inf
    assert strict.judge("t.c", zeros, zeros) == Verdict(
        "t.c", True, _metrics(0.0, 0, 2, 0.0, atol=0.0, rtol=0.0), "close(atol=0, rtol=0)", 0.0, headline="max_abs",
        tolerance=0.0)
    mask = close().judge("t.c", torch.tensor([True, False]), torch.tensor([True, True]))  # bool: zero tolerance
    assert (mask.passed, mask.margin, mask.metrics["max_abs"]) == (False, math.inf, 1.0)
    assert close().judge("t.c", torch.zeros(0), torch.zeros(0)) == Verdict(
        "t.c", True, _metrics(0.0, 0, 0, 0.0, atol=1e-05, rtol=1.3e-06), "close(atol=1e-05, rtol=1.3e-06)", 0.0,
        headline="max_abs", tolerance=1e-05)
    nan = close(atol=1.0).judge("t.c", torch.tensor([1.0, 2.0]), torch.tensor([math.nan, 2.0]))
    assert (nan.passed, nan.margin, nan.message) == (False, math.inf, NAN_MESSAGE.format(0, 1))


def test_noise_floor_verdicts():
    policy = noise_floor(0.25, k=2.0, floor=0.5, reason="bf16 control")
    text = "noise_floor(max_abs <= 2 x control 2.500e-01 + floor 5.000e-01) [bf16 control]"
    assert policy.describe() == text
    assert noise_floor(0.25).describe() == "noise_floor(max_abs <= 2 x control 2.500e-01 + floor 0.0)"
    zeros = torch.zeros(2, dtype=torch.float64)
    tie = torch.tensor([1.0, 0.0], dtype=torch.float64)  # error 1.0 == 2 x 0.25 + 0.5
    assert policy.judge("t.n", tie, zeros) == Verdict(
        "t.n", True, _metrics(1.0, 1, 2, math.inf, control=0.25, bound=1.0), text, 1.0, headline="max_abs",
        tolerance=1.0)
    over = policy.judge("t.n", torch.tensor([1.0, 0.0, 1.5]), torch.tensor([1.0, 0.0, 0.0]), dims=("row",))
    assert (over.passed, over.margin, over.message) == (
        False, 1.5, "output: max_abs 1.500e+00 exceeds 2 x control 2.500e-01 + floor 5.000e-01 = 1.000e+00; "
                    "worst element at row 2")
    assert noise_floor(0.25, k=0.5).bound == 0.125  # any k > 0, also below 1
    exact_control = noise_floor(0.0)  # a zero bound: only a zero error passes, with margin 0
    assert exact_control.judge("t.n", tie, tie.clone()).margin == 0.0
    mask = exact_control.judge("t.n", torch.tensor([True, False]), torch.tensor([True, True]))
    assert (mask.passed, mask.margin, mask.message) == (
        False, math.inf, "output: max_abs 1.000e+00 exceeds 2 x control 0.0 + floor 0.0 = 0.0; worst element at "
                         "element (1,)")
    unknown = noise_floor(math.inf).judge("t.n", tie, tie.clone())
    assert (unknown.passed, unknown.margin, unknown.message) == (False, math.inf, NAN_MESSAGE.format(0, 0))
