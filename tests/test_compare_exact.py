"""The whole Verdict of exact() on tiny hand-built tensors: metrics, margin, message, policy text.

Numbers are worked out by hand; a tie sits exactly on the bound (it passes), the next float above fails.
"""

import math

import pytest
import torch

from harness.judging.compare import UNSTAMPED, Verdict, exact
from tests.compare_expectations import NAN_MESSAGE, base_metrics, f32_bits

pytestmark = pytest.mark.cpu


def test_exact_verdicts():
    expected = torch.tensor([[0.0, 0.0], [1.0, 4.0]])
    actual = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    assert exact().judge(actual, expected, dims=("row",), what="latents") == Verdict(
        UNSTAMPED, False, base_metrics(2.0, 1, 4, pytest.approx(2 / math.sqrt(17), rel=1e-15),
                               max_ulp=f32_bits(4.0) - f32_bits(2.0)),
        "exact (bitwise)", math.inf, headline="max_abs", tolerance=0.0,
        message="latents: mismatched elements: 1 / 4 (25.0%); greatest absolute difference 2.000e+00 at row 1, "
                "element (1,) (0 allowed)")
    assert exact().judge(expected, expected.clone()) == Verdict(
        UNSTAMPED, True, base_metrics(0.0, 0, 4, 0.0, max_ulp=0), "exact (bitwise)", 0.0, headline="max_abs",
        tolerance=0.0)
    several = exact().judge(torch.tensor([0.0, 1.0, 5.0]), torch.tensor([-0.0, 1.0, 1.0]))
    assert several.message == ("output: mismatched elements: 2 / 3 (66.7%); greatest absolute difference "
                               "4.000e+00 at element (2,) (0 allowed)")
    # the worst element is the largest |difference| (+1 for any bit flip), never an equal one
    located = exact().judge(torch.tensor([1.0, 4.0, 2.0]), torch.tensor([1.0, 4.5, 3.0]))
    assert located.message == ("output: mismatched elements: 2 / 3 (66.7%); greatest absolute difference "
                               "1.000e+00 at element (2,) (0 allowed)")
    single = exact().judge(torch.tensor([1.0], dtype=torch.float64), torch.tensor([2.0], dtype=torch.float64))
    one_binade = 0x4000000000000000 - 0x3FF0000000000000  # float64 steps from 1.0 to 2.0
    assert single == Verdict(UNSTAMPED, False, base_metrics(1.0, 1, 1, 0.5, max_ulp=one_binade),
                             "exact (bitwise)", math.inf, headline="max_abs", tolerance=0.0,
                             message="output: mismatched elements: 1 / 1 (100.0%); greatest absolute difference "
                                     "1.000e+00 at element (0,) (0 allowed)")
    empty = torch.zeros(0, 3)
    assert exact().judge(empty, empty) == Verdict(
        UNSTAMPED, True, base_metrics(0.0, 0, 0, 0.0, max_ulp=0), "exact (bitwise)", 0.0, headline="max_abs",
        tolerance=0.0)
    nan = exact().judge(torch.tensor([math.nan, 1.0]), torch.tensor([0.0, 1.0]))
    assert nan == Verdict(UNSTAMPED, False, base_metrics(math.inf, 1, 2, math.inf, 1, max_ulp=f32_bits(math.nan)),
                          "exact (bitwise)", math.inf, headline="max_abs", tolerance=0.0,
                          message=NAN_MESSAGE.format(1, 0))
    mask = exact().judge(torch.tensor([True, False, True]), torch.tensor([True, True, True]), dims=("query",))
    assert mask == Verdict(UNSTAMPED, False, base_metrics(1.0, 1, 3, pytest.approx(1 / math.sqrt(3), rel=1e-15)),
                           "exact (bitwise)", math.inf, headline="max_abs", tolerance=0.0,
                           message="output: mismatched elements: 1 / 3 (33.3%); greatest absolute difference "
                                   "1.000e+00 at query 1 (0 allowed)")
    assert exact().judge(torch.zeros(2), torch.zeros(2, dtype=torch.float64), what="clips") == Verdict(
        UNSTAMPED, False, {"actual_dtype": "torch.float32", "expected_dtype": "torch.float64"}, "exact (bitwise)",
        math.inf, message="clips: dtype torch.float32 vs torch.float64")
    assert str(exact()) == "exact (bitwise)"
    with pytest.raises(ValueError, match=r"shape mismatch: actual \(2,\) vs expected \(1,\)"):
        exact().judge(torch.zeros(2), torch.zeros(1))  # no broadcasting
