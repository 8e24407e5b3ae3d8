"""The whole Verdict of ulp(n) on tiny hand-built tensors: metrics, margin, message, policy text.

Numbers are worked out by hand; a tie sits exactly on the bound (it passes), the next float above fails.
"""

import math

import pytest
import torch

from harness.judging.compare import UNSTAMPED, Verdict, ulp
from tests.compare_expectations import NAN_MESSAGE, base_metrics

pytestmark = pytest.mark.cpu


def test_ulp_verdicts():
    x = torch.tensor([1.0, -2.0, 0.0])
    y = x.clone()
    y[:1] = (x[:1].view(torch.int32) + 2).view(torch.float32)  # two float32 steps above 1.0
    two_steps = 2.0 * 2.0**-23
    metrics = base_metrics(two_steps, 1, 3, pytest.approx(two_steps / math.sqrt(5), rel=1e-15), max_ulp=2)
    assert ulp(2).judge(y, x) == Verdict(UNSTAMPED, True, metrics, "ulp(2)", 1.0, headline="max_ulp",
                                                tolerance=2.0)
    assert ulp(1).judge(y, x, dims=("row",)) == Verdict(
        UNSTAMPED, False, metrics, "ulp(1)", 2.0, headline="max_ulp", tolerance=1.0,
        message="output: 1 / 3 elements beyond 1 ULP; greatest ULP distance 2 at row 0 (up to 1 allowed)")
    assert ulp(0).judge(x, x.clone()).margin == 0.0 and ulp(0).judge(y, x).margin == math.inf
    assert ulp(0).judge(torch.zeros(0), torch.zeros(0)) == Verdict(
        UNSTAMPED, True, base_metrics(0.0, 0, 0, 0.0, max_ulp=0), "ulp(0)", 0.0, headline="max_ulp", tolerance=0.0)
    bad = ulp(5).judge(torch.tensor([math.inf]), torch.tensor([1.0]))
    assert (bad.passed, bad.margin, bad.message) == (False, math.inf, NAN_MESSAGE.format(1, 0))
    with pytest.raises(ValueError, match=r"shape mismatch: actual \(2,\) vs expected \(1,\)"):
        ulp(1).judge(torch.zeros(2), torch.zeros(1))  # no broadcasting
