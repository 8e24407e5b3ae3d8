"""The replay policies: bounds scale with the local magnitude, come from the stock control, and are bounded."""

from __future__ import annotations

import math

import pytest
import torch

from fixtures.replay_cases import real_control
from harness.replay.policies import K_MAX, K_MIN, RESOLUTION, LocalScaleBound, local_scale, local_scale_policy

pytestmark = pytest.mark.cpu


def _means(small_row_scale: float) -> torch.Tensor:
    """[B=2, S=2, 4] means: row 0 of magnitude 1, row 1 of magnitude ``small_row_scale``."""
    base = torch.linspace(-1.0, 1.0, 16, dtype=torch.float32).reshape(2, 2, 4)
    base[1] *= small_row_scale
    return base


def test_local_scale_is_per_row_for_log_probs_and_per_row_step_for_means():
    lp = torch.tensor([[-1.0, -3.0], [0.5, 0.25]])
    assert local_scale(lp, "log_probs").flatten().tolist() == [3.0, 0.5]
    means = _means(0.01)
    assert local_scale(means, "prev_sample_means").shape == (2, 2, 1)
    with pytest.raises(ValueError, match="no local scale is defined for 'ratio'"):
        local_scale(lp, "ratio")


def test_an_error_on_a_small_row_is_judged_at_that_row_scale():
    """The error below is 1e-4 of the largest value: a max-based bound would pass it; the local one does not."""
    expected = _means(0.001)
    actual = expected.clone()
    actual[1, 0, 0] += 1e-4
    policy = LocalScaleBound("prev_sample_means", relative_floor=1e-3, resolution=RESOLUTION, k=2.0)
    verdict = policy.judge("t", actual, expected, dims=("row", "step"), what="means")
    assert not verdict.passed and verdict.margin > 10
    assert "row 1, step 0" in verdict.message
    assert policy.judge("t", expected.clone(), expected).passed


def test_nan_never_passes_and_k_is_bounded_on_both_sides():
    expected = _means(1.0)
    actual = expected.clone()
    actual[0, 0, 0] = math.nan
    policy = LocalScaleBound("prev_sample_means", relative_floor=1.0, resolution=RESOLUTION, k=2.0)
    assert not policy.judge("t", actual, expected).passed
    for k in (K_MIN / 2, K_MAX * 2):
        loose = LocalScaleBound("prev_sample_means", relative_floor=1e-3, resolution=RESOLUTION, k=k)
        verdict = loose.judge("t", expected.clone(), expected)
        assert not verdict.passed and any("x the stock floor" in f for f in verdict.violated_facts)


def test_policy_is_built_from_the_stock_control():
    control = real_control("sd3", 1)
    policy = local_scale_policy(control, "log_probs", torch.bfloat16)
    assert policy.k == 2.0 and policy.resolution == RESOLUTION
    assert policy.relative_floor == pytest.approx(float(
        (control.deviation("log_probs") / local_scale(control.base_values("log_probs"), "log_probs")).max()))
    with pytest.raises(ValueError, match="no replay policy for model dtype torch.int8"):
        local_scale_policy(control, "log_probs", torch.int8)
