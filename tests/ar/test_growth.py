"""AR tolerances bounded by a floor measured on stock code, and the per-step error-growth check.

The fp32 tolerances are TOLERANCE_K x a stock floor that never collapses to 0 (the measured batch-shape floor,
at least one fp32 eps of the values' magnitude) and a verdict fails as too loose / too tight outside
[K_MIN, K_MAX] x that floor. ``ar.<model>.growth.logp`` judges the per-step error curve of a 16-token batched
rollout against the stock floor curve's growth; ``ar.logit_drift_per_step`` is caught by it and by nothing else.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fixtures import ar_models
from fixtures.ar_cases import CASES, prompt_ids
from harness.ar import judge, loop
from harness.ar import policies as ar_policies
from harness.judging import ablation, catalogue, checks
from harness.judging.compare import close
from harness.judging.floors import module_reduction_terms, reduction_ceiling_ulps
from tests.unablated import unablated_check_ids

catalogue.load()

from parity import ar_checks  # noqa: E402 - registered by the catalogue load above

DRIFT = "ar.logit_drift_per_step"
CASE = next(c for c in CASES if c.name == "unequal_real_pos")


def _rollout(logp: torch.Tensor) -> loop.Rollout:
    """A synthetic rollout carrying only log-probs (tokens all 1, every step emitted)."""
    rows, steps = logp.shape
    return loop.Rollout(tokens=torch.ones(rows, steps, dtype=torch.long), logp=logp,
                        logits=torch.zeros(rows, steps, 4), lengths=torch.full((rows,), steps),
                        real_pos=torch.full((rows,), 3), kv=tuple(torch.zeros(1, 2, 1, 3, 2) for _ in range(rows)))


# ------------------------------------------------------------------------------------ the stock floor


@pytest.mark.cpu
def test_floor_never_collapses_when_batched_equals_alone_bitwise():
    floor = ar_policies.StockPrefillFloor(logp=0.0, kv=0.0, backend="bitwise", logp_scale=24.0, kv_scale=3.0)
    assert floor.floor("logp") == ar_policies.FP32_EPS * 24.0 > 0
    assert floor.floor("kv") == floor.floor("slot0") == ar_policies.FP32_EPS * 3.0
    policies = ar_policies.fp32_policies(floor)
    ulp = ar_policies.FP32_EPS * 24.0  # the floor: one fp32 ulp at the log-probs' magnitude
    expected = torch.tensor([[-24.0, -1.0]], dtype=torch.float64)
    assert policies.logp.judge(expected + 7.9 * ulp, expected).passed  # 8 floors of room, on the floor's minimum
    assert not policies.logp.judge(expected + 8.1 * ulp, expected).passed
    assert "measured 0.00e+00" in policies.logp.reason and "1 float32 ulps x magnitude 24" in policies.logp.reason
    assert floor.stock_floor("logp").at_minimum and floor.stock_floor("kv").minimum == ar_policies.FP32_EPS * 3.0


@pytest.mark.cpu
@pytest.mark.parametrize("model", ar_models.BACKENDS)
def test_floor_is_measured_on_the_model_and_printed_beside_the_tolerance(model):
    case = CASES[0]
    floor = ar_checks._floor(model, case)
    assert floor.backend == model and floor.logp_scale > 0 and floor.kv_scale > 0
    assert (floor.rows, floor.length) == (case.batch_size, case.batch().width)  # the fast path's shape
    verdict = checks.run_check(f"ar.{model}.{case.name}.logp", checks.CheckContext())
    assert verdict.passed, verdict.describe()
    assert verdict.tolerance == pytest.approx(8.0 * floor.floor("logp"))  # the fp32 room: 8 stock floors
    assert verdict.metrics["floor_measured"] == floor.logp and verdict.metrics["stock_floor"] == floor.floor("logp")
    assert f"{floor.floor('logp'):.2e}" in verdict.policy
    assert any("atol within [4, 16] x the stock floor" in note for note in verdict.notes)


@pytest.mark.cpu
def test_non_finite_stock_floor_is_refused():
    floor = ar_policies.StockPrefillFloor(logp=math.inf, kv=1e-6, backend="broken", logp_scale=1.0, kv_scale=1.0)
    with pytest.raises(ValueError, match="stock floor of logp on broken"):
        ar_policies.fp32_policies(floor)
    with pytest.raises(ValueError, match="'logp' or 'kv'"):
        floor.floor("tokens")


@pytest.mark.cpu
@pytest.mark.parametrize(("k", "text"), [(2 * ar_policies.K_MAX, "too loose"), (ar_policies.K_MIN / 2, "too tight")])
def test_tolerance_outside_the_floor_bounds_fails(k, text):
    """A policy judged at a tolerance beyond [K_MIN, K_MAX] x the stock floor fails, whatever the error."""
    model = "qwen3"
    floor = ar_checks._floor(model, CASE)
    policies = ar_policies.fp32_policies(floor)
    atol = k * floor.floor("logp")
    policies = dataclasses.replace(policies, logp=close(atol=atol, rtol=0.0, reason="hand-set"))
    fast = loop.fast_rollout(ar_models.backend(model), CASE.batch(), CASE.max_new_tokens)
    verdict = judge.compare_case("logp", fast, ar_checks._reference(model, CASE),
                                    policies)
    assert not verdict.passed
    assert any(text in fact for fact in verdict.violated_facts), verdict.describe()
    assert verdict.metrics["stock_floor"] == floor.floor("logp")


# ------------------------------------------------------------------------------------ growth judge


@pytest.mark.cpu
def test_growth_judge_passes_flat_noise_and_fails_growth_and_nan():
    gen = torch.Generator().manual_seed(3)
    reference = _rollout(-1.0 - torch.rand(4, 12, generator=gen))
    noise = lambda: 1e-6 * torch.randn(4, 12, generator=gen)  # noqa: E731
    control = reference.logp + noise()
    flat = judge.judge_growth(_rollout(reference.logp + noise()), reference, control)
    assert flat.passed, flat.describe()
    ramp = torch.logspace(-7, -4, 12)[None]
    grown = judge.judge_growth(_rollout(reference.logp + ramp), reference, control)
    assert not grown.passed and grown.margin > 1, grown.describe()
    nan = reference.logp.clone()
    nan[1, 7] = math.nan
    assert not judge.judge_growth(_rollout(nan), reference, control).passed


@pytest.mark.cpu
def test_growth_judge_floors_bitwise_curves_at_the_resolution():
    """Batched == B=1 == control bitwise: both curves sit at one eps x |logp|, growth 1, the check passes."""
    reference = _rollout(torch.full((3, 9), -2.0))
    verdict = judge.judge_growth(reference, reference, reference.logp.clone())
    assert verdict.passed, verdict.describe()
    assert verdict.metrics["error_growth"] == verdict.metrics["floor_growth"] == 1.0


@pytest.mark.cpu
def test_growth_ratio_and_step_curve_values():
    assert judge.growth_ratio(torch.tensor([1.0, 1, 1, 2, 2, 2, 4, 4, 4])) == 4.0
    assert judge.growth_ratio(torch.tensor([0.0, 0, 0, 0, 0, 0])) == 0.0
    assert judge.growth_ratio(torch.tensor([0.0, 0, 1, 1, 1, 1])) == math.inf
    assert judge.growth_ratio(torch.tensor([1.0, math.nan, 1, 1, 1, 1])) == math.inf
    actual = torch.tensor([[1.0, 2.0, 3.0], [1.0, 4.0, 0.0]])
    expected = torch.zeros(2, 3)
    curve = judge.step_curve(actual, expected, torch.tensor([3, 2]))  # row 1 stopped after two steps
    assert curve.tolist() == [1.0, 3.0, 3.0] and curve.dtype == torch.float64
    reference = _rollout(torch.tensor([[-1.0, -2.0, -4.0], [-3.0, -2.0, -4.0]]))
    assert judge.resolution_curve(reference).tolist() == [ar_policies.FP32_EPS * v for v in (2.0, 2.0, 4.0)]


@pytest.mark.cpu
def test_growth_ratio_reads_whole_thirds():
    assert judge.growth_ratio(torch.tensor([1.0, 2, 3, 4, 5, 6])) == 5.5 / 1.5  # thirds of two steps
    assert judge.growth_ratio(torch.tensor([1.0, 2, 4])) == 4.0  # thirds of one step
    assert judge.growth_ratio(torch.tensor([1.0, 2, 3, 4, 5, 6, 7, 8])) == 7.5 / 1.5  # 8 // 3 = 2


@pytest.mark.cpu
def test_curves_leave_out_the_steps_a_row_never_emitted():
    actual = torch.tensor([[1.0, 2.0, 3.0], [1.0, 4.0, 9.0]])  # row 1's third step was never emitted
    curve = judge.step_curve(actual, torch.zeros(2, 3), torch.tensor([3, 2]))
    assert curve.tolist() == [1.0, 3.0, 3.0]
    with pytest.raises(ValueError, match=r"two \[B, N\] tensors, got \(2, 3\) vs \(2, 2\)"):
        judge.step_curve(actual, torch.zeros(2, 2), torch.tensor([3, 2]))
    with pytest.raises(ValueError, match=r"got \(6,\) vs \(6,\)"):
        judge.step_curve(actual.flatten(), torch.zeros(6), torch.tensor([3, 2]))
    reference = dataclasses.replace(_rollout(torch.tensor([[-1.0, -2.0, -4.0], [-3.0, -2.0, -8.0]])),
                                    lengths=torch.tensor([3, 2]))
    resolution = judge.resolution_curve(reference)
    assert resolution.dtype == torch.float64
    assert resolution.tolist() == [ar_policies.FP32_EPS * v for v in (2.0, 2.0, 4.0)]


@pytest.mark.cpu
def test_growth_judge_reads_a_shrinking_floor_as_flat_and_requires_equal_tokens():
    reference = _rollout(torch.full((2, 9), -1.0))
    shrinking = reference.logp + torch.logspace(-5, -7, 9)[None]
    error = reference.logp + 1.5e-6 * torch.tensor([1.0, -1.0] * 4 + [1.0])[None]  # flat, growth 1
    verdict = judge.judge_growth(_rollout(error), reference, shrinking)
    assert verdict.metrics["floor_growth"] < 0.1 and verdict.tolerance == judge.GROWTH_BUDGET
    assert verdict.passed, verdict.describe()
    other = dataclasses.replace(_rollout(error), tokens=torch.full((2, 9), 2))
    verdict = judge.judge_growth(other, reference, shrinking)
    assert any("batched tokens equal B=1" in fact for fact in verdict.violated_facts)


@pytest.mark.cpu
def test_growth_judge_refuses_short_curves():
    reference = _rollout(torch.full((2, 5), -1.0))
    with pytest.raises(ValueError, match=">= 6 steps"):
        judge.judge_growth(reference, reference, reference.logp)


# ---------------------------------------------------------------------------- the compounding drift


@pytest.fixture(scope="module")
def baselines(parity_session, parity_ctx):
    return unablated_check_ids("ar", parity_session, parity_ctx)


@pytest.mark.cpu
def test_logit_drift_is_caught_by_error_growth_and_nothing_else(baselines, parity_ctx):
    item = ablation.get(DRIFT)
    growth = {f"ar.{m}.growth.logp" for m in ar_models.BACKENDS}
    assert set(item.kills) == growth
    results = {check_id: ablation.run_under(item, check_id, parity_ctx) for check_id in baselines}
    killed = {c: r.how for c, r in results.items() if r.mode != "survived"}
    assert set(killed) == growth, killed
    assert all(results[c].killed and results[c].mode == "tolerance" for c in growth)


@pytest.mark.cpu
@pytest.mark.parametrize("model", ar_models.BACKENDS)
def test_logit_drift_stays_under_the_worst_element_tolerance(model, baselines):
    """On all 16 steps of the growth case the drifted log-probs pass the fp32 worst-element logp check."""
    case = ar_checks.GROWTH_CASE
    reference = ar_checks._reference(model, case)
    with ablation.get(DRIFT).apply():
        fast = loop.fast_rollout(ar_models.backend(model), case.batch(), case.max_new_tokens)
    policies = ar_policies.fp32_policies(ar_checks._floor(model, case))
    for what in ("tokens", "logp"):
        verdict = judge.compare_case(what, fast, reference, policies)
        assert verdict.passed, verdict.describe()
    plain = loop.fast_rollout(ar_models.backend(model), case.batch(), case.max_new_tokens)
    drift = (fast.logp.double() - plain.logp.double()).abs().mean(dim=0)  # the drift alone, made by the ablation
    assert float(drift[:11].abs().max()) == 0.0 and float(drift[-3:].mean()) > 0, f"the drift: {drift.tolist()}"
    assert float(drift[-2:].mean()) > 4 * float(drift[11:13].mean()), f"the drift must grow: {drift.tolist()}"


@pytest.mark.cpu
def test_logit_drift_is_an_exact_no_op_up_to_step_ten():
    """The relative drift rounds to 0 in fp32 up to step 10: every rollout of <= 11 tokens is bitwise untouched."""
    from mutation import ar_ablations

    assert [ar_ablations._relative_drift(k) for k in range(11)] == [0.0] * 11
    assert ar_ablations._relative_drift(11) > 0
    backend = ar_models.backend("fake")
    plain = loop.fast_rollout(backend, CASE.batch(), 11)
    with ablation.get(DRIFT).apply():
        drifted = loop.fast_rollout(backend, CASE.batch(), 11)
    assert torch.equal(plain.logp, drifted.logp) and torch.equal(plain.logits, drifted.logits)


@pytest.mark.cpu
def test_the_growth_control_floor_is_its_worst_emitted_step():
    """The floor is the largest |d log-prob| over the steps a row emitted (a later, unemitted step never counts)."""
    reference = _rollout(torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]]))
    reference.lengths[1] = 2
    control = reference.logp.clone()
    control[0, 1] += 1e-3
    control[1, 2] += 5.0  # row 1 emitted two tokens: its third step is not compared
    floor = judge.growth_control_floor(control, reference, terms=64)
    assert floor.measured == pytest.approx(1e-3, rel=1e-4) and floor.magnitude == 3.0
    assert floor.ulps == 1.0  # its stated minimum: one fp32 ulp of the largest log-prob
    control[0, 1] -= 3e-3  # a control below the reference counts by its magnitude too
    assert judge.growth_control_floor(control, reference, terms=64).measured == pytest.approx(2e-3, rel=1e-4)
    reference.lengths[:] = 0  # no row emitted a token: nothing was measured, whatever the control holds
    silent = judge.growth_control_floor(control, reference, terms=64)
    assert (silent.measured, silent.magnitude) == (0.0, 0.0)


@pytest.mark.cpu
def test_the_growth_control_floor_magnitude_and_ceiling_come_from_the_emitted_steps_and_the_terms():
    """Log-probs under one in size: the magnitude is their largest emitted one, never a filler of the unemitted
    steps; the ceiling is the reduction's over ``terms``, one term at the least."""
    reference = _rollout(torch.tensor([[-0.25, -0.125, -0.5]]))
    reference.lengths[0] = 2
    floor = judge.growth_control_floor(reference.logp.clone(), reference, terms=1)
    assert floor.magnitude == 0.25 and floor.measured == 0.0
    assert floor.ceiling_ulps == reduction_ceiling_ulps(1)
    no_terms = judge.growth_control_floor(reference.logp.clone(), reference, terms=0)
    assert no_terms.ceiling_ulps == reduction_ceiling_ulps(1)


@pytest.mark.cpu
def test_the_batch_shape_control_scores_stock_logits_in_float64() -> None:
    """Each row's stock logits at the batch's shape, read at its own row, scored by an fp64 log-softmax (rounded
    to fp32 once at the end, as the rollouts' own log-probs are)."""
    backend = ar_models.backend("qwen3")
    prompts = prompt_ids([5, 8], seed=61)
    reference = loop.stock_rollout(backend, prompts, 4)
    width, slots = 8, 12
    control = judge.batch_shape_control_logp(backend, prompts, reference, width, slots)
    for row, prompt in enumerate(prompts):
        count = int(reference.lengths[row])
        tokens = reference.tokens[row, :count]
        with torch.no_grad():
            logits = backend.stock_padded(prompt, tokens, width, slots, rows=2, row=row)
        want = torch.log_softmax(logits.double(), dim=-1).gather(-1, tokens[:, None])[:, 0].float()
        assert torch.equal(control[row, :count], want), (control[row, :count] - want).tolist()
    assert not control[0, int(reference.lengths[0]):].any() and not control[1, int(reference.lengths[1]):].any()


@pytest.mark.cpu
def test_the_prefill_floor_counts_the_model_s_reductions_and_the_vocabulary_s_log_sum_exp() -> None:
    backend = ar_models.backend("qwen3")
    floor = ar_policies.stock_prefill_floor(backend)
    assert floor.terms == module_reduction_terms(backend.model, sequence=floor.length) + backend.vocab_size
