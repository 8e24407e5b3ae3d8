"""The whole Verdict of noise_floor() on tiny hand-built tensors: metrics, margin, message, policy text.

Numbers are worked out by hand; a tie sits exactly on the bound (it passes), the next float above fails.
"""

import math

import pytest
import torch

from harness.judging.compare import UNSTAMPED, Verdict, noise_floor
from tests.compare_expectations import NAN_MESSAGE, base_metrics

pytestmark = pytest.mark.cpu


def test_noise_floor_verdicts():
    policy = noise_floor(0.25, k=2.0, floor=0.5, reason="bf16 control")
    text = "noise_floor(max_abs <= 2 x control 2.500e-01 + floor 5.000e-01) [bf16 control]"
    assert policy.describe() == text
    assert noise_floor(0.25).describe() == "noise_floor(max_abs <= 2 x control 2.500e-01 + floor 0.0)"
    zeros = torch.zeros(2, dtype=torch.float64)
    tie = torch.tensor([1.0, 0.0], dtype=torch.float64)  # error 1.0 == 2 x 0.25 + 0.5
    assert policy.judge(tie, zeros) == Verdict(
        UNSTAMPED, True, base_metrics(1.0, 1, 2, math.inf, control=0.25, bound=1.0), text, 1.0, headline="max_abs",
        tolerance=1.0)
    over = policy.judge(torch.tensor([1.0, 0.0, 1.5]), torch.tensor([1.0, 0.0, 0.0]), dims=("row",))
    assert (over.passed, over.margin, over.message) == (
        False, 1.5, "output: max_abs 1.500e+00 exceeds 2 x control 2.500e-01 + floor 5.000e-01 = 1.000e+00; "
                    "worst element at row 2")
    assert noise_floor(0.25, k=0.5).bound == 0.125  # any k > 0, also below 1
    half = noise_floor(0.125, k=2.0, floor=0.25).judge(torch.tensor([1.5]), torch.tensor([0.0]))
    assert (half.passed, half.margin, half.tolerance) == (False, 3.0, 0.5)  # margin = error / bound
    for k, floor in ((0.0, 0.0), (-1.0, 0.0), (1.0, -1e-9)):
        with pytest.raises(ValueError, match=f"noise_floor needs k > 0 and floor >= 0, got k={k}, floor={floor}"):
            noise_floor(0.25, k=k, floor=floor)
    exact_control = noise_floor(0.0)  # a zero bound: only a zero error passes, with margin 0
    assert exact_control.judge(tie, tie.clone()).margin == 0.0
    mask = exact_control.judge(torch.tensor([True, False]), torch.tensor([True, True]))
    assert (mask.passed, mask.margin, mask.message) == (
        False, math.inf, "output: max_abs 1.000e+00 exceeds 2 x control 0.0 + floor 0.0 = 0.0; worst element at "
                         "element (1,)")
    unknown = noise_floor(math.inf).judge(tie, tie.clone())
    assert (unknown.passed, unknown.margin, unknown.message) == (False, math.inf, NAN_MESSAGE.format(0, 0))
    both = policy.judge(torch.tensor([math.nan, 1.0]), torch.tensor([math.inf, 1.0]))
    assert both == Verdict(UNSTAMPED, False, base_metrics(math.inf, 1, 2, math.inf, 2, control=0.25, bound=1.0), text,
                           math.inf, headline="max_abs", tolerance=1.0, message=NAN_MESSAGE.format(1, 1))
    with pytest.raises(ValueError, match=r"shape mismatch: actual \(2,\) vs expected \(1,\)"):
        noise_floor(1.0).judge(torch.zeros(2), torch.zeros(1))  # no broadcasting
