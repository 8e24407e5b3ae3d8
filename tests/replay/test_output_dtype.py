"""Outputs an implementation returns in the trajectory dtype by its declared convention: judged against the stock
values rounded the same way (one ulp of that dtype per element on a local-scale bound, exact stays exact), named in
the row; returned so without the declaration, a failed fact that says how to declare it."""

from __future__ import annotations

import pytest
import torch

from harness.judging.compare import exact
from harness.plugins import conformance
from harness.plugins.declarations import ReplayDeclaration
from harness.replay.judge import declared_output_dtype, judge_result
from harness.replay.policies import LocalScaleBound, rounded_to, ulp_of

pytestmark = pytest.mark.cpu

TARGET = (0, 2)


@pytest.fixture
def declares(monkeypatch):
    def use(declaration):
        monkeypatch.setattr(conformance, "declaration", lambda path: declaration)
    return use


def _means() -> torch.Tensor:
    return torch.randn(3, len(TARGET), 4, 4, generator=torch.Generator().manual_seed(2)) * 3


def _bound() -> LocalScaleBound:
    return LocalScaleBound("prev_sample_means", 1e-7, 4.768e-7, 4.0, "fp32", terms=100)


def test_the_spacing_of_a_dtype_is_one_ulp_at_each_magnitude():
    values = torch.tensor([1.0, 1.5, 3.0, -0.25, 0.0])
    spacing = ulp_of(values, torch.bfloat16)
    assert spacing[:4].tolist() == [2.0 ** -7, 2.0 ** -7, 2.0 ** -6, 2.0 ** -9]
    assert float(spacing[4]) == 2.0 ** -133  # at zero: the spacing at the smallest normal (2^-126), never 0
    assert ulp_of(torch.tensor([1.0]), torch.float32).item() == 2.0 ** -23
    assert spacing.dtype == torch.float64  # compared with fp64 differences


def test_a_bound_on_outputs_rounded_to_a_dtype_rounds_the_stock_side_alike():
    """An implementation returning stock's values rounded to bf16 differs from stock rounded alike by nothing."""
    expected = torch.linspace(-1.0, 1.0, 24, dtype=torch.float64).reshape(1, 2, 3, 4) / 3
    bound = LocalScaleBound("prev_sample_means", 1e-7, 4.768e-7, 4.0, "fp32", rounded_to=torch.bfloat16)
    verdict = bound.judge(expected.to(torch.bfloat16), expected)
    assert verdict.passed and verdict.metrics["max_abs"] == 0.0


def test_a_low_precision_bound_writes_its_ceiling_in_fp32_ulps_of_the_models_dtype():
    from harness.judging.floors import reduction_ceiling_ulps

    bf16 = LocalScaleBound("prev_sample_means", 1e-3, 4.768e-7, 4.0, "bf16", terms=100).stock_floor
    assert bf16.ceiling_ulps == reduction_ceiling_ulps(100) * 2.0 ** 16  # a bf16 ulp is 2^16 fp32 ulps


def test_means_in_the_declared_trajectory_dtype_are_judged_against_stock_rounded_alike(declares):
    declares(ReplayDeclaration(means_dtype="trajectory"))
    stock = _means()
    verdict = judge_result(_bound(), stock.to(torch.bfloat16), stock, TARGET, "prev_sample_means", torch.bfloat16)
    assert verdict.passed, verdict.describe()
    assert verdict.headline == "max_relative_to_local_in_bfloat16"
    assert verdict.metrics["output_dtype"] == "bfloat16 (declared: the trajectory dtype)"
    assert "+ 1 torch.bfloat16 ulp of each element" in verdict.policy


def test_a_difference_of_a_few_ulps_of_the_declared_dtype_still_fails(declares):
    declares(ReplayDeclaration(means_dtype="trajectory"))
    stock = _means()
    rounded = stock.to(torch.bfloat16)
    off = rounded.clone()
    off[1, 1, 2, 3] = (rounded[1, 1, 2, 3].float() + 3 * ulp_of(rounded[1, 1, 2, 3], torch.bfloat16).float()).to(
        torch.bfloat16)
    verdict = judge_result(_bound(), off, stock, TARGET, "prev_sample_means", torch.bfloat16)
    assert not verdict.passed and "worst at row 1, step 2" in verdict.message


def test_one_ulp_apart_after_rounding_passes_when_the_fp32_values_were_within_the_bound(declares):
    """Two fp32 values a rounding boundary falls between round one bf16 ulp apart: the bound allows that ulp."""
    declares(ReplayDeclaration(means_dtype="trajectory"))
    boundary = torch.tensor(1.0 + 2.0 ** -8)  # halfway between two bf16 values
    stock = torch.full((1, 2, 2), float(boundary - 2.0 ** -22))
    implementation = torch.full((1, 2, 2), float(boundary + 2.0 ** -22))
    assert not torch.equal(stock.to(torch.bfloat16), implementation.to(torch.bfloat16))
    bound = LocalScaleBound("prev_sample_means", 1e-7, 4.768e-7, 4.0, "fp32")
    verdict = judge_result(bound, implementation.to(torch.bfloat16), stock, TARGET, "prev_sample_means",
                           torch.bfloat16)
    assert verdict.passed, verdict.describe()


def test_exact_stays_exact_after_rounding(declares):
    declares(ReplayDeclaration(means_dtype="trajectory"))
    assert rounded_to(exact(), torch.bfloat16) == exact()
    stock = _means()
    assert judge_result(exact(), stock.to(torch.bfloat16), stock, TARGET, "prev_sample_means", torch.bfloat16).passed
    off = stock.to(torch.bfloat16).clone()
    off[0, 0, 0, 0] = off[0, 0, 0, 0] * 2
    assert not judge_result(exact(), off, stock, TARGET, "prev_sample_means", torch.bfloat16).passed


@pytest.mark.parametrize("declaration", [None, ReplayDeclaration(), ReplayDeclaration(log_probs_dtype="trajectory")])
def test_a_lower_dtype_without_the_declaration_fails_saying_how_to_declare_it(declares, declaration):
    declares(declaration)
    stock = _means()
    verdict = judge_result(_bound(), stock.to(torch.bfloat16), stock, TARGET, "prev_sample_means", torch.bfloat16)
    assert not verdict.passed
    assert verdict.violated_facts == ["prev_sample_means comes back in torch.float32, as the stock path returns it"]
    assert verdict.metrics["hint"].endswith("ReplayDeclaration(means_dtype='trajectory')")
    assert verdict.metrics["returned_dtype"] == "torch.bfloat16"


def test_the_convention_holds_only_for_the_trajectory_dtype_and_the_declared_quantity(declares):
    declares(ReplayDeclaration(means_dtype="trajectory"))
    assert declared_output_dtype("prev_sample_means run2", torch.bfloat16, torch.bfloat16) == torch.bfloat16
    assert declared_output_dtype("prev_sample_means", torch.float16, torch.bfloat16) is None  # not the trajectory's
    assert declared_output_dtype("log_probs", torch.bfloat16, torch.bfloat16) is None  # log-probs not declared
    assert declared_output_dtype("pi_old ratio", torch.bfloat16, torch.bfloat16) is None
    declares(ReplayDeclaration(log_probs_dtype="trajectory"))
    assert declared_output_dtype("log_probs", torch.bfloat16, torch.bfloat16) == torch.bfloat16
