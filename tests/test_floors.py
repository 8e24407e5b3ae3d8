"""Every tolerance policy at a measured stock floor of exactly 0, of one ulp, and of a typical size.

A floor is measured on stock code and can be exactly zero on one host (batch-invariant kernels) and not on
another. Each policy must then (1) never collapse: its bound stays at least k_min x its stated minimum in ulps
of the compared quantity's own magnitude, (2) still pass a candidate that differs by one ulp of that
magnitude, (3) keep "too loose" / "too tight" meaningful, and (4) record which floor applied.
"""

from __future__ import annotations

import math

import pytest
import torch

from fixtures.replay_cases import fake_problem
from harness.ar import judge
from harness.ar import policies as ar_policies
from harness.attention.policies import FloorControl, RowControl, RowScaledFloor, bounded, floor_policy, rel_l2_bound
from harness.judging.compare import UNSTAMPED, Verdict, holds
from harness.judging.floors import CEILING_C, StockFloor, eps, module_reduction_terms, reduction_ceiling_ulps
from harness.judging.growth import GROWTH_BUDGET, judge_growth
from harness.replay.controls import BatchShapeControl
from harness.replay.policies import RESOLUTION, LocalScaleBound, local_scale_policy
from harness.replay.segment import ReplayResult

pytestmark = pytest.mark.cpu

EPS = eps(torch.float32)
# measured floors as multiples of one ulp at the compared magnitude: zero, one ulp, a typical GEMM-order floor
FLOORS = {"zero": 0.0, "one_ulp": 1.0, "typical": 37.0}


# --------------------------------------------------------------------------------------------- StockFloor


def test_a_stock_floor_is_its_measurement_or_its_minimum_whichever_is_larger():
    zero = StockFloor(0.0, 24.0, 2.0, source="batched vs alone")
    assert (zero.minimum, zero.value, zero.at_minimum) == (2 * EPS * 24.0, 2 * EPS * 24.0, True)
    assert zero.metrics() == {"floor_measured": 0.0, "floor_minimum": 2 * EPS * 24.0, "floor_minimum_ulps": 2.0,
                              "floor_at_minimum": True}
    assert "measured 0.00e+00 (batched vs alone), 2 float32 ulps x magnitude 24" in zero.describe()
    measured = StockFloor(1e-3, 24.0, 2.0)
    assert (measured.value, measured.at_minimum) == (1e-3, False)
    assert StockFloor(1.0, 1.0, 1.0, torch.bfloat16).minimum == 2.0**-7  # a bf16 ulp at 1
    assert math.isinf(StockFloor(math.inf, 1.0, 1.0).value) and not StockFloor(math.inf, 1.0, 1.0).at_minimum
    for bad in ({"ulps": 0.0}, {"ulps": math.inf}, {"measured": -1.0}, {"magnitude": -1.0}):
        with pytest.raises(ValueError):
            StockFloor(**{"measured": 0.0, "magnitude": 1.0, "ulps": 1.0, **bad})


def test_a_floor_above_its_ceiling_fails_as_a_stock_path_that_depends_on_the_batch():
    """The ceiling is stated from the arithmetic (CEILING_C x sqrt(K) ulps of the magnitude): a floor measured above
    it is a bug's size, not rounding, and the verdict fails saying so instead of widening its bound."""
    assert reduction_ceiling_ulps(64) == CEILING_C * 8.0
    rounding = StockFloor(3 * EPS, 1.0, 1.0, ceiling_ulps=reduction_ceiling_ulps(64), ceiling_reason="K = 64: test")
    assert not rounding.above_ceiling and rounding.metrics()["floor_ceiling"] == CEILING_C * 8.0 * EPS
    ok = Verdict(UNSTAMPED, True, {}, "p", 0.1).require_bounded(4 * rounding.value, rounding, k_min=2, k_max=8)
    assert ok.passed and "ok: the stock floor is rounding: measured" in "; ".join(ok.notes)
    bug = StockFloor(0.0554, 1.0, 1.0, source="the adapter at S x B rows", ceiling_ulps=reduction_ceiling_ulps(64),
                     ceiling_reason="K = 64: test")
    failed = Verdict(UNSTAMPED, True, {}, "p", 0.1).require_bounded(4 * bug.value, bug, k_min=2, k_max=8)
    assert not failed.passed
    assert failed.violated_facts[0].startswith(
        "the stock path itself depends on the batch composition (or on what shares its forward): its floor measured "
        "5.540e-02 on the adapter at S x B rows is above the ceiling rounding allows")
    assert StockFloor(math.nan, 1.0, 1.0, ceiling_ulps=2.0, ceiling_reason="x").above_ceiling
    for bad in ({"ceiling_ulps": 0.5}, {"ceiling_ulps": 4.0, "ceiling_reason": ""}):
        with pytest.raises(ValueError):
            StockFloor(**{"measured": 0.0, "magnitude": 1.0, "ulps": 1.0, "ceiling_reason": "x", **bad})


def test_module_reduction_terms_count_every_linear_and_conv_fan_in():
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Conv2d(3, 4, kernel_size=3), torch.nn.Linear(16, 2))
    assert module_reduction_terms(net) == 8 + 3 * 9 + 16
    assert module_reduction_terms(net, sequence=40) == 8 + 27 + 16 + 40
    assert module_reduction_terms(torch.nn.ReLU()) == 1


def test_require_bounded_keeps_too_loose_and_too_tight_meaningful_at_a_zero_floor():
    floor = StockFloor(0.0, 1.0, 4.0)
    fact = holds(True, "ran")
    inside = fact.require_bounded(8 * floor.minimum, floor, k_min=2.0, k_max=8.0)
    assert inside.passed and inside.metrics["floor_at_minimum"] and inside.metrics["stock_floor"] == floor.minimum
    loose = fact.require_bounded(9 * floor.minimum, floor, k_min=2.0, k_max=8.0)
    tight = fact.require_bounded(1 * floor.minimum, floor, k_min=2.0, k_max=8.0)
    assert "too loose" in loose.violated_facts[0] and "too tight" in tight.violated_facts[0]


# ------------------------------------------------------------------------------------------ replay policies


@pytest.mark.parametrize("ulps", FLOORS.values(), ids=FLOORS.keys())
def test_replay_local_scale_bound(ulps):
    """Relative floors: one ulp of a relative quantity is one fp32 eps; the minimum is RESOLUTION (4 ulps)."""
    policy = LocalScaleBound("log_probs", relative_floor=ulps * EPS, resolution=RESOLUTION, k=4.0)
    expected = torch.tensor([[-3.0, -1.5], [-0.25, -8.0]])
    assert policy.relative_bound >= 4.0 * RESOLUTION
    same = policy.judge(expected.clone(), expected)
    assert same.passed and same.metrics["floor_at_minimum"] == (ulps * EPS < RESOLUTION)
    one_ulp = expected + EPS * expected.abs().amax(dim=1, keepdim=True)  # one ulp of each row's magnitude
    assert policy.judge(one_ulp, expected).passed
    off = expected * (1 + 2 * policy.relative_bound)
    assert not policy.judge(off, expected).passed


@pytest.mark.parametrize(("dtype", "room_ulps"), [(torch.float32, 16.0), (torch.bfloat16, 8.0)])
@pytest.mark.parametrize(("share", "passed"), [(0.98, True), (1.03, False)])
def test_a_batch_shape_exact_control_leaves_the_replay_k_resolutions_of_room(dtype, room_ulps, share, passed):
    """A control with no deviation (the CPU tier's tiny models are often batch-shape exact) still leaves room:
    4 fp32 ulps of each row's magnitude, times k (4 for an fp32 model, 2 for a 16-bit one). Just inside passes;
    just outside fails."""
    log_probs = torch.tensor([[-3.0, -1.5], [-0.25, -8.0]], dtype=torch.float64)
    stock = ReplayResult(log_probs, torch.zeros(2, 2, 1, dtype=torch.float64), (0, 1))
    policy = local_scale_policy(BatchShapeControl(stock, stock, 2), "log_probs", dtype)
    assert policy.relative_floor == 0.0
    offset = share * room_ulps * EPS * log_probs.abs().amax(dim=1, keepdim=True)
    verdict = policy.judge(log_probs + offset, log_probs)
    assert verdict.passed is passed, verdict.describe()


@pytest.mark.parametrize("ulps", FLOORS.values(), ids=FLOORS.keys())
def test_replay_pi_old_ratio_floor(ulps):
    """The ratio exp(dlogp) is near 1: its minimum counts ulps of 1 (or of the log-probs where larger), with or
    without a measured floor."""
    from parity.replay_oracle_checks import RATIO_FLOOR_ULPS, ratio_stock_floor

    problem = fake_problem("cfg2")
    magnitude = max(1.0, float(problem.segment.recorded_log_probs(problem.target).abs().max()))
    floor = ratio_stock_floor(problem, (ulps * EPS, ulps * EPS, 0.0))
    assert floor.minimum == RATIO_FLOOR_ULPS * EPS * magnitude > 0
    assert floor.value == max(ulps * EPS, floor.minimum)
    assert floor.value >= EPS  # a one-ulp ratio error (the measured 1.5e-8 on one host is below it) passes


@pytest.mark.parametrize("ulps", FLOORS.values(), ids=FLOORS.keys())
def test_replay_oracle_bound(ulps):
    from parity.replay_oracle_checks import K_ORACLE, _bounded

    oracle = torch.tensor([2.0, -4.0, 0.5], dtype=torch.float64)
    scale = float(oracle.abs().max())
    verdict = _bounded("mean", oracle + EPS * scale, oracle, ulps * EPS * scale, scale)
    if ulps > reduction_ceiling_ulps(16):  # above the formula's ceiling (K = 16 steps here) it is not rounding
        assert verdict.violated_facts[0].startswith("the stock computation in float32 loses more than rounding")
        return
    assert verdict.passed, verdict.describe()
    assert verdict.metrics["bound"] >= K_ORACLE * EPS * scale
    assert verdict.metrics["floor_at_minimum"] == (ulps < 1)
    far = _bounded("mean", oracle + 2 * verdict.metrics["bound"], oracle, ulps * EPS * scale, scale)
    assert not far.passed


# ------------------------------------------------------------------------------------------------ growth


@pytest.mark.parametrize("ulps", FLOORS.values(), ids=FLOORS.keys())
def test_growth_judge(ulps):
    """Per-step curves over 9 steps; the resolution is one ulp of a magnitude-2 quantity at every step."""
    resolution = torch.full((9,), 2 * EPS, dtype=torch.float64)
    floor = torch.full((9,), ulps * 2 * EPS, dtype=torch.float64)
    flat = judge_growth(resolution.clone(), floor, resolution, control="test")
    assert flat.passed, flat.describe()
    assert flat.tolerance == GROWTH_BUDGET and flat.metrics["floor_at_minimum"] is False  # a flat floor: growth 1
    assert flat.metrics["floor_points_at_resolution"] == (9 if ulps <= 1 else 0)
    growing = judge_growth(resolution * torch.logspace(0, 3, 9, dtype=torch.float64), floor, resolution,
                           control="test")
    assert not growing.passed and growing.margin > 1
    assert "worst element" not in growing.message and "the error first exceeds 2 x the stock floor at step " in \
        growing.message, growing.message
    late = torch.cat([resolution[:6], resolution[6:] * 1e4])  # flat, then a jump at step 6
    jumped = judge_growth(late, floor, resolution, control="test")
    shown = max(float(floor[6]), float(resolution[6]))  # both curves are floored at the resolution first
    assert f"at step 6 of 9 ({float(late[6]):.2e} vs floor {shown:.2e}; 3 step(s) above it)" in \
        jumped.message, jumped.message
    zero_everything = judge_growth(torch.zeros(9), torch.zeros(9), resolution, control="test")
    assert zero_everything.passed and zero_everything.metrics["error_growth"] == 1.0
    # the headline is the growth ratio it judged, not an elementwise metric of one number
    assert zero_everything.headline == "error_growth" and zero_everything.headline_value == 1.0
    assert not {"max_abs", "mismatched", "total", "rel_l2"} & set(zero_everything.metrics)


# ----------------------------------------------------------------------------------------------------- ar


@pytest.mark.parametrize("ulps", FLOORS.values(), ids=FLOORS.keys())
def test_ar_fp32_policies(ulps):
    scale = 12.5
    floor = ar_policies.StockPrefillFloor(logp=ulps * EPS * scale, kv=ulps * EPS * 3.0, backend="hand",
                                       logp_scale=scale, kv_scale=3.0)
    policies = ar_policies.fp32_policies(floor)
    minimum = ar_policies.FLOOR_ULPS * EPS * scale
    assert policies.logp.atol == 8.0 * max(ulps * EPS * scale, minimum) >= 8 * minimum  # 8 floors of room
    expected = torch.tensor([[-scale, -1.0]])
    verdict = policies.logp.judge(expected + EPS * scale, expected)  # one ulp at the magnitude
    verdict = judge.require_floor_bounds(verdict, policies.logp.atol, floor, "logp")
    assert verdict.passed, verdict.describe()
    assert verdict.metrics["floor_at_minimum"] == (ulps < ar_policies.FLOOR_ULPS)
    loose = judge.require_floor_bounds(verdict, 2 * ar_policies.K_MAX * floor.floor("logp"), floor, "logp")
    assert any("too loose" in fact for fact in loose.violated_facts)


# ---------------------------------------------------------------------------------------------- attention


@pytest.mark.parametrize("ulps", FLOORS.values(), ids=FLOORS.keys())
def test_attention_fp32_policy(ulps):
    scale = 1.75
    control = FloorControl(ulps * EPS * scale, ulps * EPS, "torch.float32", scale)
    policy = floor_policy(control)
    expected = torch.tensor([[scale, -0.5, 0.25]])
    verdict = bounded(policy.judge(expected + EPS * scale, expected), policy, control.max_abs_floor())
    assert verdict.passed, verdict.describe()
    assert policy.bound >= 4 * EPS * scale and rel_l2_bound(control) >= 4 * EPS
    assert verdict.metrics["floor_at_minimum"] == (ulps < 1)


@pytest.mark.parametrize("ulps", FLOORS.values(), ids=FLOORS.keys())
def test_attention_bf16_row_policy(ulps):
    bf16 = eps(torch.bfloat16)
    policy = RowScaledFloor(RowControl(ulps * bf16, "batch 0, head 0, query row 0", "torch.bfloat16"), k=4.0)
    expected = torch.tensor([[[[1.0, -2.0], [0.5, 0.25]]]], dtype=torch.float64)
    one_ulp = expected + bf16 * expected.abs().amax(dim=-1, keepdim=True)
    verdict = bounded(policy.judge(one_ulp, expected), policy, None)
    assert verdict.passed, verdict.describe()
    assert verdict.metrics["floor_at_minimum"] == (ulps < 1)
    assert not policy.judge(expected * 3.0, expected).passed  # off by twice each row's magnitude


@pytest.mark.parametrize("shapes", [((6, 2), (6, 2), (6, 2)), ((6,), (7,), (6,)), ((6,), (6,), (5,))])
def test_growth_curves_must_be_one_dimensional_and_of_one_length(shapes):
    """A per-step curve is 1-D: a [steps, rows] error would be read step by step as if its rows were steps."""
    error, floor, resolution = (torch.full(shape, 1e-6, dtype=torch.float64) for shape in shapes)
    with pytest.raises(ValueError, match="growth curves must be 1-D and of one length"):
        judge_growth(error, floor, resolution, control="a stock control")


def test_growth_needs_a_finite_floor_and_a_positive_resolution_at_every_step():
    fact = "stock per-step floor finite on all 9 steps, each point floored at a positive resolution"
    resolution = torch.full((9,), 2 * EPS, dtype=torch.float64)
    flat = torch.full((9,), 4 * EPS, dtype=torch.float64)
    assert judge_growth(flat, flat, resolution, control="test").passed
    unfloored = resolution.clone()
    unfloored[4] = 0.0
    infinite = flat.clone()
    infinite[4] = torch.inf
    for error, floor, res in ((flat, flat, unfloored), (flat, infinite, resolution)):
        verdict = judge_growth(error, floor, res, control="test")
        assert not verdict.passed and fact in verdict.violated_facts, verdict.describe()


@pytest.mark.parametrize(("budget", "loose"), [(3.9, False), (4.1, True)])
def test_a_growth_budget_may_be_at_most_four_times_a_flat_floors_growth(budget, loose):
    resolution = torch.full((9,), 2 * EPS, dtype=torch.float64)
    verdict = judge_growth(resolution.clone(), resolution.clone(), resolution, control="test", budget=budget)
    assert verdict.passed is not loose and any("too loose" in f for f in verdict.violated_facts) is loose, \
        verdict.describe()


def test_growth_curves_are_reported_to_four_significant_digits():
    resolution = torch.full((6,), 2 * EPS, dtype=torch.float64)
    error = torch.tensor([1.23456e-6, 2.0e-6, 3.0e-6, 3.0e-6, 2.0e-6, 1.0e-6], dtype=torch.float64)
    verdict = judge_growth(error, resolution.clone(), resolution, control="test")
    assert verdict.metrics["error_curve"] == [1.235e-6, 2.0e-6, 3.0e-6, 3.0e-6, 2.0e-6, 1.0e-6]
    assert verdict.metrics["floor_curve"] == [float(f"{2 * EPS:.4g}")] * 6


def test_first_departure_names_the_first_step_over_its_floor_or_says_none_is():
    from harness.judging.growth import first_departure

    floor = torch.tensor([1.0, 1.0, 1.0, 1.0])
    said = first_departure(torch.tensor([1.0, 2.5, 1.5, 3.0]), floor, 2.0)
    assert said == ("the error first exceeds 2 x the stock floor at step 1 of 4 (2.50e+00 vs floor 1.00e+00; 2 step(s) "
                    "above it)")
    assert first_departure(torch.tensor([1.0, 1.5, 2.0, 2.0]), floor, 2.0) == (
        "no single step exceeds 2 x its floor: the error grows across the steps")


def test_an_attention_output_reduces_over_the_head_dim_and_twice_the_keys() -> None:
    from harness.attention.capture import Capture
    from harness.attention.policies import attention_terms

    query = torch.zeros(1, 3, 2, 8)  # (B, S, H, D): 3 queries, 2 heads, head dim 8
    key = torch.zeros(1, 5, 2, 8)
    capture = Capture(query, key, key.clone(), torch.ones(1, 1, 3, 5, dtype=torch.bool))
    assert attention_terms(capture) == 8 + 2 * 5


def test_a_replay_problem_without_a_module_states_no_reduction_terms() -> None:
    from types import SimpleNamespace

    from harness.replay.controls import replay_terms

    terms = replay_terms(SimpleNamespace(adapter=SimpleNamespace()))
    assert terms == 0 and isinstance(terms, int)


def test_a_pipeline_step_attends_over_the_prompts_tokens_and_the_latent_grid() -> None:
    from types import SimpleNamespace

    from harness.replay.pipeline_oracle import AlignedStep, _tokens

    adapter = SimpleNamespace(latent_size=(2, 3))
    embedded = AlignedStep([], {"prompt": torch.zeros(2, 7, 16)}, {}, torch.zeros(1))
    assert _tokens(embedded, "prompt", adapter) == 7 + 6
    pooled = AlignedStep([], {"prompt": torch.zeros(2, 16)}, {}, torch.zeros(1))
    assert _tokens(pooled, "prompt", adapter) == 6

