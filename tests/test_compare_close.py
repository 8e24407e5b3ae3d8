"""The whole Verdict of close(atol, rtol) on tiny hand-built tensors: metrics, margin, message, policy text.

Numbers are worked out by hand; a tie sits exactly on the bound (it passes), the next float above fails.
"""

import math

import pytest
import torch

from harness.judging.compare import UNSTAMPED, Verdict, close
from tests.compare_expectations import NAN_MESSAGE, base_metrics

pytestmark = pytest.mark.cpu


def test_close_verdicts():
    assert str(close()) == "close(atol=default, rtol=default)"
    for bad in ({"atol": -1e-9}, {"rtol": math.inf}, {"atol": math.nan}):
        with pytest.raises(ValueError, match=f"close\\(\\) needs a finite {next(iter(bad))} >= 0"):
            close(**bad)
    assert close(1e-3, 0.02, reason="bf16 floor").describe() == "close(atol=0.001, rtol=0.02) [bf16 floor]"
    assert close().describe(torch.float32) == "close(atol=1e-05, rtol=1.3e-06)"
    zeros = torch.zeros(2, dtype=torch.float64)
    tie = torch.tensor([0.5, 0.0], dtype=torch.float64)
    assert close(atol=0.5, rtol=0).judge(tie, zeros) == Verdict(
        UNSTAMPED, True, base_metrics(0.5, 1, 2, math.inf, atol=0.5, rtol=0.0), "close(atol=0.5, rtol=0)", 1.0,
        headline="max_abs", tolerance=0.5)
    above = torch.tensor([0.5, math.nextafter(0.5, 1.0)], dtype=torch.float64)  # one on the bound, one over
    over = close(atol=0.5, rtol=0).judge(above, zeros, dims=("row",), labels={"row": [7, 9]})
    assert (over.passed, over.margin, over.message) == (
        False, math.nextafter(0.5, 1.0) / 0.5,
        "output: mismatched elements: 1 / 2 (50.0%); greatest absolute difference 5.000e-01 at row 9 "
        "(up to 5.000e-01 allowed)")
    # rtol scales |expected|: a negative reference still allows rtol * 10
    negative = close(atol=0, rtol=0.1).judge(torch.tensor([-10.5, 1.0], dtype=torch.float64),
                                             torch.tensor([-10.0, 1.0], dtype=torch.float64))
    assert (negative.passed, negative.margin) == (True, 0.5)
    below = close(atol=0.5, rtol=0).judge(torch.tensor([0.0, -1.0], dtype=torch.float64), zeros)
    assert (below.passed, below.margin) == (False, 2.0)
    strict = close(atol=0, rtol=0)
    assert strict.judge(torch.tensor([0.0, 2.0]), torch.tensor([0.0, 2.0])).margin == 0.0
    no_room = strict.judge(torch.tensor([0.5]), torch.tensor([0.0]))
    assert (no_room.margin, no_room.message) == (
        math.inf, "output: mismatched elements: 1 / 1 (100.0%); greatest absolute difference 5.000e-01 at element (0,) "
                  "(up to 0.0 allowed)")
    assert strict.judge(zeros, zeros) == Verdict(
        UNSTAMPED, True, base_metrics(0.0, 0, 2, 0.0, atol=0.0, rtol=0.0), "close(atol=0, rtol=0)", 0.0,
        headline="max_abs", tolerance=0.0)
    mask = close().judge(torch.tensor([True, False]), torch.tensor([True, True]))  # bool: zero tolerance
    assert (mask.passed, mask.margin, mask.metrics["max_abs"]) == (False, math.inf, 1.0)
    assert close().judge(torch.zeros(0), torch.zeros(0)) == Verdict(
        UNSTAMPED, True, base_metrics(0.0, 0, 0, 0.0, atol=1e-05, rtol=1.3e-06), "close(atol=1e-05, rtol=1.3e-06)", 0.0,
        headline="max_abs", tolerance=1e-05)
    nan = close(atol=1.0).judge(torch.tensor([1.0, 2.0]), torch.tensor([math.nan, 2.0]))
    assert (nan.passed, nan.margin, nan.message) == (False, math.inf, NAN_MESSAGE.format(0, 1))
    assert nan.metrics == base_metrics(math.inf, 1, 2, math.inf, 1, atol=1.0, rtol=1.3e-06)
    # float32 inputs: the allowed bound is formed in float64 (0.1 * 3 = 0.30000000000000004, not float32's 0.3)
    scaled = close(atol=0, rtol=0.1).judge(torch.tensor([3.25]), torch.tensor([3.0]))
    assert scaled.passed and scaled.margin == pytest.approx(0.25 / (0.1 * 3.0), rel=1e-12)
    with pytest.raises(ValueError, match=r"shape mismatch: actual \(2,\) vs expected \(1,\)"):
        close().judge(torch.zeros(2), torch.zeros(1))  # no broadcasting
