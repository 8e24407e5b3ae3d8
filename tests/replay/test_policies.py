"""The replay policies: bounds scale with the local magnitude, come from the stock control, and are bounded."""

from __future__ import annotations

import math

import pytest
import torch

from fixtures.replay_cases import real_control
from harness.judging.compare import close
from harness.replay.controls import BatchShapeControl
from harness.replay.judge import judge_result
from harness.replay.policies import (
    K_MAX,
    K_MIN,
    RESOLUTION,
    LocalScaleBound,
    k_for,
    local_scale,
    local_scale_policy,
    relative_floor,
)
from harness.replay.segment import ReplayResult

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
    verdict = policy.judge(actual, expected, dims=("row", "step"), what="means")
    assert not verdict.passed and verdict.margin > 10
    assert "row 1, step 0" in verdict.message
    assert policy.judge(expected.clone(), expected).passed


def test_nan_never_passes_and_k_is_bounded_on_both_sides():
    expected = _means(1.0)
    actual = expected.clone()
    actual[0, 0, 0] = math.nan
    policy = LocalScaleBound("prev_sample_means", relative_floor=1.0, resolution=RESOLUTION, k=2.0)
    assert not policy.judge(actual, expected).passed
    for k in (K_MIN / 2, K_MAX * 2):
        loose = LocalScaleBound("prev_sample_means", relative_floor=1e-3, resolution=RESOLUTION, k=k)
        verdict = loose.judge(expected.clone(), expected)
        assert not verdict.passed and any("x the stock floor" in f for f in verdict.violated_facts)


@pytest.mark.parametrize(("k", "fact"), [(1.9, "too tight"), (2.1, "within"), (7.9, "within"), (8.1, "too loose")])
def test_k_is_admitted_from_2_to_8_times_the_stock_floor(k, fact):
    """Just inside the band a policy judges; just outside it fails as mis-set, even on an exact output."""
    expected = _means(1.0)
    verdict = LocalScaleBound("prev_sample_means", relative_floor=1e-3, resolution=RESOLUTION, k=k).judge(
        expected.clone(), expected)
    assert verdict.passed is (fact == "within"), verdict.describe()
    assert any(fact in note for note in verdict.notes), verdict.notes


def test_policy_is_built_from_the_stock_control():
    control = real_control("sd3", 1)
    policy = local_scale_policy(control, "log_probs", torch.bfloat16)
    assert policy.k == 2.0 and policy.resolution == RESOLUTION
    assert policy.relative_floor == pytest.approx(float(
        (control.deviation("log_probs") / local_scale(control.base_values("log_probs"), "log_probs")).max()))
    with pytest.raises(ValueError, match="no replay policy for model dtype torch.int8"):
        local_scale_policy(control, "log_probs", torch.int8)


# ------------------------------------------------------------------ exact bounds on hand-made inputs

def _control(base_lp, grown_lp) -> BatchShapeControl:
    """A control built by hand: log-probs [B, S] at B rows and in the bigger batch (means unused: zeros)."""
    base, grown = (torch.as_tensor(v, dtype=torch.float32) for v in (base_lp, grown_lp))
    means = torch.zeros(*base.shape, 2)
    target = tuple(range(base.shape[1]))
    return BatchShapeControl(ReplayResult(base, means, target), ReplayResult(grown, means.clone(), target), 2)


# rows of scale 2, 0.5 and 0 (all zero): relative deviations 0.25, 0.5 and 0 / 0 = 0
HAND_BASE = [[-2.0, 1.0], [0.5, 0.25], [0.0, 0.0]]
HAND_GROWN = [[-2.5, 1.0], [0.5, 0.0], [0.0, 0.0]]


def test_control_deviation_is_the_absolute_fp64_difference():
    control = _control(HAND_BASE, HAND_GROWN)
    deviation = control.deviation("log_probs")
    assert deviation.dtype == torch.float64
    assert deviation.tolist() == [[0.5, 0.0], [0.0, 0.25], [0.0, 0.0]]
    assert control.max_deviation("log_probs") == 0.5
    assert control.base_values("log_probs").tolist() == HAND_BASE
    with pytest.raises(ValueError, match=r"what must be one of \('log_probs', 'prev_sample_means'\), got 'ratio'"):
        control.deviation("ratio")


def test_relative_floor_is_the_largest_deviation_over_its_row_scale():
    """0.5 / 2 on row 0, 0.25 / 0.5 on row 1 (a scale below 1 still divides), 0 on the all-zero row."""
    assert relative_floor(_control(HAND_BASE, HAND_GROWN), "log_probs") == 0.5
    assert relative_floor(_control(HAND_BASE, HAND_BASE), "log_probs") == 0.0


def test_relative_floor_of_a_deviation_on_an_all_zero_row_is_infinite():
    assert relative_floor(_control([[0.0, 0.0], [1.0, 1.0]], [[0.0, 1e-6], [1.0, 1.0]]), "log_probs") == math.inf


def test_relative_floor_of_an_empty_control_is_zero():
    empty = torch.zeros(0, 2)
    assert relative_floor(_control(empty, empty), "log_probs") == 0.0


def test_local_scale_is_a_detached_fp64_constant():
    values = torch.tensor([[-1.0, -3.0], [0.5, 0.25]], requires_grad=True)
    scale = local_scale(values, "log_probs")
    assert scale.dtype == torch.float64 and not scale.requires_grad
    assert scale.tolist() == [[3.0], [0.5]]


# k = 4 x floor 0.25: relative bound exactly 1.0, so |d| may reach the local magnitude
HAND_POLICY = LocalScaleBound("log_probs", relative_floor=0.25, resolution=RESOLUTION, k=4.0)
EXPECTED_LP = torch.tensor([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0]])


def _metrics(max_abs, total, nonfinite, relative, **more):
    return {"max_abs": max_abs, "total": total, "nonfinite": nonfinite, "max_relative_to_local": relative,
            "relative_floor": 0.25, "resolution": RESOLUTION, "relative_bound": 1.0, "k": 4.0,
            "stock_floor": 0.25, "tolerance_bound": 1.0, "floor_measured": 0.25, "floor_minimum": RESOLUTION,
            "floor_minimum_ulps": 4.0, "floor_at_minimum": False, **more}


def test_policy_description_names_dtype_k_floor_and_resolution():
    assert HAND_POLICY.describe() == (
        "local_scale(fp32 log_probs: |d| <= 4 x max(floor 2.50e-01, resolution 4.77e-07) x local |log_probs|; "
        "floor = stock serial at B rows vs at the fast path's S x cfg x B-row shape, relative to the local magnitude)")
    assert HAND_POLICY.effective_floor == 0.25 and HAND_POLICY.relative_bound == 1.0


def _a_pass_reports_every_metric_and_an_all_zero_row_needs_zero_error():
    actual = EXPECTED_LP + torch.tensor([[0.5, 0.0, -0.25], [0.0, 0.0, 0.0]])
    verdict = HAND_POLICY.judge(actual, EXPECTED_LP, dims=("row", "step"), what="log_probs")
    assert (verdict.passed, verdict.margin, verdict.tolerance, verdict.headline, verdict.message) == (
        True, 0.5, 1.0, "max_relative_to_local", "")
    assert verdict.metrics == _metrics(0.5, 6, 0, 0.5)
    assert verdict.policy == HAND_POLICY.describe()
    half = LocalScaleBound("log_probs", relative_floor=0.25, resolution=RESOLUTION, k=2.0)  # bound 0.5
    halved = half.judge(actual, EXPECTED_LP)
    assert (halved.passed, halved.margin, halved.metrics["max_relative_to_local"]) == (True, 1.0, 0.5)


def _an_error_at_the_bound_passes_and_only_errors_beyond_it_are_counted():
    """|d| == allowed (ratio 1) passes; ratio 2 and any error on the all-zero row (ratio inf) fail."""
    at_bound = EXPECTED_LP + torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert HAND_POLICY.judge(at_bound, EXPECTED_LP).margin == 1.0
    assert HAND_POLICY.judge(at_bound, EXPECTED_LP).passed
    for error in (1.5, -1.5):
        beyond = HAND_POLICY.judge(EXPECTED_LP + torch.tensor([[error, 0.0, 0.0], [0.0, 0.0, 0.0]]), EXPECTED_LP)
        assert (beyond.passed, beyond.margin, beyond.metrics["max_abs"]) == (False, 1.5, 1.5)
    actual = EXPECTED_LP + torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.5, 0.0]])
    verdict = HAND_POLICY.judge(actual, EXPECTED_LP, dims=("row", "step"), labels={"step": [0, 3, 6]},
                                what="log_probs")
    assert (verdict.passed, verdict.margin) == (False, math.inf)
    assert verdict.metrics == _metrics(2.0, 6, 0, math.inf)
    assert verdict.message == ("log_probs: 2 / 6 elements beyond the local bound; worst at row 1, step 3: |d| "
                               "5.000e-01 (up to 0.000e+00 allowed = 1.00e+00 x local |log_probs| 0.000e+00)")


def _non_finite_values_on_either_side_are_counted_and_fail():
    actual, expected = EXPECTED_LP.clone(), EXPECTED_LP.clone()
    actual[0, 0] = math.nan
    expected[1, 1], expected[1, 2] = math.inf, -math.inf
    verdict = HAND_POLICY.judge(actual, expected, what="log_probs")
    assert (verdict.passed, verdict.margin) == (False, math.inf)
    assert verdict.metrics["nonfinite"] == 3 and verdict.metrics["max_relative_to_local"] == math.inf
    assert verdict.message == "log_probs: non-finite values or floor; NaN/Inf never pass"


def _empty_outputs_pass_with_zero_error():
    verdict = HAND_POLICY.judge(torch.zeros(0, 3), torch.zeros(0, 3))
    assert (verdict.passed, verdict.margin) == (True, 0.0)
    assert verdict.metrics == _metrics(0.0, 0, 0, 0.0)


def _shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match=r"log_probs: shapes \(2, 3\) and \(3, 2\) differ"):
        HAND_POLICY.judge(EXPECTED_LP, EXPECTED_LP.T, what="log_probs")


def test_judge_on_hand_made_log_probs():
    """Every judged case in one test, so a mutation of the judge meets all of them."""
    for case in (_a_pass_reports_every_metric_and_an_all_zero_row_needs_zero_error,
                 _an_error_at_the_bound_passes_and_only_errors_beyond_it_are_counted,
                 _non_finite_values_on_either_side_are_counted_and_fail, _empty_outputs_pass_with_zero_error,
                 _shape_mismatch_is_an_error):
        case()


def test_k_per_model_dtype():
    assert [k_for(d) for d in (torch.float32, torch.bfloat16, torch.float16)] == [4.0, 2.0, 2.0]
    with pytest.raises(ValueError, match=r"no replay policy for model dtype torch.float64; expected one of "
                                         r"\['torch.bfloat16', 'torch.float16', 'torch.float32'\]"):
        k_for(torch.float64)


@pytest.mark.parametrize(("dtype", "k", "name"), [(torch.float32, 4.0, "fp32"), (torch.float16, 2.0, "fp16")])
def test_policy_from_a_hand_made_control(dtype, k, name):
    policy = local_scale_policy(_control(HAND_BASE, HAND_GROWN), "log_probs", dtype)
    assert policy == LocalScaleBound("log_probs", 0.5, RESOLUTION, k, name)
    assert policy.resolution == 4 * torch.finfo(torch.float32).eps  # 4 fp32 ulps, the SDE math's resolution


def test_a_failed_replay_verdict_names_the_steps_that_went_wrong_over_every_row():
    """[B, S] outputs: the per-step worst error is taken over the rows of each step, in target order."""
    expected = torch.full((2, 3), -1.0, dtype=torch.float64)  # nonzero: the error is a difference, not a size
    actual = expected.clone()
    actual[1, 2] = -0.5  # row 1, third target step
    actual[0, 1] = -1.25  # row 0, second target step: an error below the reference counts as much
    verdict = judge_result(close(1e-3, 0.0), actual, expected, [4, 5, 6], "log_probs")
    assert not verdict.passed
    assert verdict.metrics["max_abs_per_step"] == "step 4: 0.000e+00, step 5: 2.500e-01, step 6: 5.000e-01"


def test_a_local_scale_ceiling_never_lies_below_the_floor_s_own_minimum():
    """With few reduction terms and a coarse resolution the resolution bounds the ceiling from below: the stock floor
    at its minimum is then exactly at its ceiling, never above it."""
    from harness.judging.floors import CEILING_C

    coarse_ulps = 10 * CEILING_C  # above the one-term reduction ceiling
    policy = LocalScaleBound("log_probs", relative_floor=0.0, resolution=coarse_ulps * torch.finfo(torch.float32).eps,
                             k=2.0, terms=1)
    floor = policy.stock_floor
    assert floor.ceiling_ulps == pytest.approx(coarse_ulps) and floor.ulps == pytest.approx(coarse_ulps)
    assert not floor.above_ceiling, floor.describe()
