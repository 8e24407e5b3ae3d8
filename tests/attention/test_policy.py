"""The attention tolerance policies on hand-computed rows: the per-row bf16 bound, its edge cases (zero
rows, ties, NaN, no rows), the relative-L2 twin and the two-sided bound around a measured floor."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fixtures.attention_captures import small_capture
from harness.attention import policies
from harness.attention.layout import AttentionLayout
from harness.attention.policies import FloorControl, RowControl, RowScaledFloor
from harness.judging.compare import close, holds, noise_floor

pytestmark = pytest.mark.cpu

CONTROL = RowControl(0.01, "batch 0, head 0, query row 0", "torch.bfloat16")
DIMS = ("batch", "head", "query row")


def _judge(actual, truth, control=CONTROL, reason=""):
    return RowScaledFloor(control, 4.0, reason=reason).judge(torch.tensor([[actual]]),
                                                              torch.tensor([[truth]]), dims=DIMS, what="out")


def test_each_row_is_bounded_by_its_own_largest_magnitude_in_fp64():
    truth = [[-3.0, 1.0, 0.5], [0.25, -0.5, 0.125], [0.0, 0.0, 0.0]]
    actual = [[-3.0, 0.97, 0.5], [0.251, -0.5, 0.125], [0.0, 0.0, 0.0]]
    verdict = _judge(actual, truth)
    error0 = abs(float(torch.tensor(0.97)) - 1.0)  # the fp32 input, differenced in fp64
    ratio0 = error0 / (4.0 * 0.01 * 3.0)  # row 0's magnitude is 3 (a negative entry)
    assert (verdict.passed, verdict.margin, verdict.tolerance, verdict.headline) == (True, pytest.approx(
        ratio0, rel=1e-12), 1.0, "row_ratio")
    assert verdict.metrics["worst_row"] == "batch 0, head 0, query row 0"
    assert verdict.metrics["worst_row_error"] == pytest.approx(error0, rel=1e-12)
    assert verdict.metrics["worst_row_scale"] == 3.0
    assert verdict.message == ""


def test_a_row_whose_truth_is_zero_allows_no_error():
    verdict = _judge([[1.0, 1.0], [0.0, 0.5]], [[1.0, 1.0], [0.0, 0.0]])
    assert (verdict.passed, verdict.margin, verdict.metrics["worst_row"]) == (False, math.inf,
                                                                            "batch 0, head 0, query row 1")
    assert verdict.message.startswith("out: 1 / 2 query rows beyond the row bound; worst at batch 0, head 0, query "
                                      "row 1: max|d| 5.000e-01 > 4 x 1.000e-02 x row max|ref| 0.000e+00")


@pytest.mark.parametrize(("error", "passed"), [(1.0, True), (1.5, False)])
def test_the_row_bound_is_inclusive(error, passed):
    tie = RowControl(0.125, "batch 0, head 0, query row 0", "torch.bfloat16")  # 4 x 0.125 x 2 = 1 exactly
    verdict = _judge([[2.0 - error, 0.0]], [[2.0, 0.0]], control=tie)
    assert (verdict.passed, verdict.margin, verdict.message == "") == (passed, error, passed)


@pytest.mark.parametrize(("where", "counts"), [("actual", "2 non-finite output values in 1 query rows (0 in the "
                                                          "reference)"),
                                               ("expected", "0 non-finite output values in 0 query rows (1 in the "
                                                            "reference)")])
def test_nan_never_passes_the_row_bound_and_the_headline_counts_it(where, counts):
    values = {"actual": [[1.0, 2.0], [3.0, 4.0]], "expected": [[1.0, 2.0], [3.0, 4.0]]}
    values[where] = [[1.0, float("nan")], [3.0, 4.0]] if where == "expected" else [[1.0, 2.0], [float("nan")] * 2]
    verdict = _judge(values["actual"], values["expected"])
    assert (verdict.passed, verdict.margin, verdict.tolerance, verdict.headline) == (False, math.inf, 1.0, "nonfinite")
    assert verdict.message == f"out: {counts}; NaN/Inf never pass"


def test_the_non_finite_headline_counts_query_rows_not_heads():
    verdict = _judge([[float("nan"), 2.0], [3.0, float("inf")], [5.0, 6.0]], [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    assert (verdict.metrics["nonfinite"], verdict.metrics["nonfinite_rows"]) == (2, 2), verdict.metrics


def test_no_query_rows_pass_with_zero_margin():
    empty = torch.zeros(1, 1, 0, 4)
    verdict = RowScaledFloor(CONTROL).judge(empty, empty, dims=DIMS)
    assert (verdict.passed, verdict.margin) == (True, 0.0)
    assert {k: verdict.metrics[k] for k in ("row_ratio", "worst_row", "worst_row_error", "worst_row_scale")} == {
        "row_ratio": 0.0, "worst_row": "none", "worst_row_error": 0.0, "worst_row_scale": 0.0}


def test_row_scaled_floor_describes_its_bound_and_reason():
    plain = RowScaledFloor(CONTROL, 4.0)
    text = ("row_scaled(max|d| per query row <= 4 x 1.000e-02 x the row's max|ref|, control: torch.bfloat16 masked "
            "SDPA vs fp64)")
    assert (plain.describe(), RowScaledFloor(CONTROL, 4.0, reason="why").describe()) == (text, f"{text} [why]")


def test_row_control_measures_against_the_given_truth_or_fp64():
    capture = small_capture(AttentionLayout(2, 3, 1, "denoise"), heads=1, head_dim=8, seed=9)
    truth = policies.reference_output(capture, torch.float64)
    measured = policies.row_control(capture, torch.bfloat16)
    assert measured == policies.row_control(capture, torch.bfloat16, truth)
    assert 0 < measured.relative < 0.05 and measured.dtype == "torch.bfloat16"
    doubled = policies.row_control(capture, torch.bfloat16, 2 * truth)  # every row off by its own magnitude
    assert doubled.relative == pytest.approx(0.5, rel=0.05)


def test_rel_l2_bound_is_k_times_the_measured_relative_l2():
    control = FloorControl(1e-6, 2e-7, "torch.float32")
    assert (policies.rel_l2_bound(control), policies.rel_l2_bound(control, 3.0)) == (8e-7, pytest.approx(6e-7))


def test_bound_and_floor_pairs_each_policy_with_its_floor():
    row = RowScaledFloor(CONTROL, 4.0)
    bound, floor = policies.bound_and_floor(row, None)
    assert (bound, floor.measured, floor.value) == (0.04, 0.01, 0.01)  # a row floor carries its bf16-ulp minimum
    assert floor.minimum == torch.finfo(torch.bfloat16).eps
    assert policies.bound_and_floor(noise_floor(1e-6, 4.0), 1e-6) == (4e-6, 1e-6)
    assert policies.bound_and_floor(noise_floor(1e-6, 4.0), None) is None
    assert policies.bound_and_floor(close(1e-5, 0.0), 1e-6) is None


def test_bounds_sit_within_2_and_16_times_their_floor():
    for k, passed in ((2.0, True), (16.0, True), (1.9, False), (16.5, False)):
        verdict = policies.bounded(holds(True, "ran"), noise_floor(1e-6, k), 1e-6)
        assert (verdict.passed, verdict.metrics["bound_floor_multiple"]) == (passed, pytest.approx(k)), k


def test_a_bound_without_a_measured_floor_is_too_loose():
    verdict = policies.bounded(holds(True, "ran"), noise_floor(0.0, 4.0), 0.0)
    assert verdict.metrics["bound_floor_multiple"] == math.inf
    untied = policies.bounded(holds(True, "ran"), close(1e-5, 0.0), None)
    assert not untied.passed
    assert untied.violated_facts == [f"tolerance of {close(1e-5, 0.0).describe()} is too loose: it is not a multiple "
                                     "of a floor measured on stock code"]


@pytest.mark.parametrize(("multiple", "passed"), [(3.9, True), (4.1, False)])
def test_the_fp32_bounds_allow_a_kernel_four_floors_and_no_more(multiple, passed):
    """The default fp32 room: up to 4 x stock masked SDPA's own error against fp64, in max|d| and relative L2."""
    control = FloorControl(1e-6, 2e-7, "torch.float32", scale=1.0)
    expected = torch.zeros(1, 1, 2, 4, dtype=torch.float64)
    actual = expected.clone()
    actual[0, 0, 1, 2] = multiple * 1e-6
    verdict = policies.floor_policy(control).judge(actual, expected, dims=("batch", "head", "query row", "channel"),
                                                     what="out")
    assert verdict.passed is passed, verdict.describe()
    assert (multiple * control.rel_l2 <= policies.rel_l2_bound(control)) is passed


def test_a_floor_control_without_a_magnitude_bounds_by_its_measurement_alone():
    """No stated magnitude, no ulp minimum to widen the floor: a 1e-9 measurement gives a 4e-9 bound, not 4 ulps."""
    control = FloorControl(1e-9, 1e-9, "torch.float32")
    assert (control.max_abs_floor().value, control.max_abs_floor().at_minimum) == (1e-9, False)
    expected = torch.zeros(1, 1, 1, 2, dtype=torch.float64)
    for multiple, passed in ((3.9, True), (4.1, False)):
        actual = torch.tensor([[[[multiple * 1e-9, 0.0]]]], dtype=torch.float64)
        verdict = policies.floor_policy(control).judge(actual, expected, what="out")
        assert verdict.passed is passed, (multiple, verdict.describe())


@pytest.mark.parametrize(("multiple", "passed"), [(3.9, True), (4.1, False)])
def test_the_bf16_bound_allows_a_kernel_four_row_floors_and_no_more(multiple, passed):
    """The default low-precision room: per row, 4 x stock bf16 masked SDPA's own relative error against fp64."""
    capture = small_capture(AttentionLayout(2, 3, 1, "denoise"), heads=1, head_dim=8, seed=9)
    truth = policies.reference_output(capture, torch.float64)
    policy = policies.low_precision_policy(capture, torch.bfloat16, truth)
    actual = truth.clone()
    row = truth[0, 0, 1]
    actual[0, 0, 1, 0] += multiple * policy.control.relative_floor * float(row.abs().max())
    verdict = policy.judge(actual, truth, dims=DIMS, what="out")
    assert verdict.passed is passed, verdict.describe()
    assert verdict.metrics["worst_row"] == "batch 0, head 0, query row 1"


def test_the_fp32_floor_counts_its_minimum_in_the_output_s_magnitude_whatever_its_sign():
    """Negating the values negates the output exactly: the same errors, the same magnitude (max |value|), so the
    same floor, even where every output is negative."""
    capture = small_capture(AttentionLayout(2, 3, 1, "denoise"), heads=1, head_dim=8, seed=9)
    positive = dataclasses.replace(capture, value=capture.value.abs() + 0.5)
    negative = dataclasses.replace(capture, value=-positive.value)
    assert float(policies.reference_output(negative, torch.float64).max()) < 0  # every output is negative
    up, down = policies.floor_control(positive), policies.floor_control(negative)
    assert (down.max_abs, down.rel_l2, down.scale) == (up.max_abs, up.rel_l2, up.scale)
    magnitude = float(policies.reference_output(positive, torch.float64).abs().max())
    assert up.scale == magnitude > 0.5  # every output averages values above 0.5
    assert down.max_abs_floor().minimum == up.max_abs_floor().minimum == 2.0**-23 * magnitude  # 1 fp32 ulp
