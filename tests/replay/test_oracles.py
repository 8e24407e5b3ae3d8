"""The replay oracles' own tests: the fp64 references, the strict fake, and what the oracle-only
ablations prove -- parity survives bugs in shared code, and a compounding drift below the
single-step tolerance is caught by the error-growth check and by nothing else."""

import math

import pytest
import torch

from fakes.replay_conditions import HI3_FIELDS, fused_conditions
from fakes.replay_kernel import FakeDenoiser, FakeKernel
from fixtures.replay_families import family_names
from harness.judging import ablation, catalogue, checks
from harness.replay import oracles, tiling
from harness.replay.conditions import Conditions, concat_payloads
from harness.replay.denoiser import FUSED_COND_FIRST
from harness.replay.judge import judge_result, run_both
from tests.unablated import unablated_check_ids

catalogue.load()

from parity import replay_oracle_checks as roc  # noqa: E402 - registered by the catalogue load above

SHARED = ("replay.log_prob_sign_flipped", "replay.log_prob_floor_div", "replay.std_off_by_sqrt2",
          "replay.mean_drops_one_minus_sigma", "replay.cfg_halves_swapped")
# Checks judged against the log-probs a CACHED rollout recorded before the ablation was applied: a bug in
# the shared SDE code then differs from a record the same bug would have produced in a real rollout.
STALE_RECORD = ("replay.cfg1.pi_old_ratio", "replay.cfg2.pi_old_ratio", "replay.uncond_first.pi_old_ratio",
                "replay.sd3.cfg2.pi_old_ratio")
# Parity checks run under each shared-piece ablation: every fake-kernel check (bitwise) and one
# tiny-diffusers check per family and quantity (the same shared code path; the full set costs ~10 s each).
REAL_SAMPLE = ("replay.sd3.cfg2.log_probs", "replay.sd3.cfg2.prev_sample_means", "replay.flux.cfg2.log_probs",
               "replay.flux.cfg2.prev_sample_means", "replay.flux.cfg2.pi_old_vs_rollout")
REAL_FAMILIES = tuple(f"replay.{name}." for name in family_names())
GROWTH = tuple(f"replay.{name}.growth.prev_sample_means" for name in family_names())
GROWTH_CFG2 = tuple(f"replay.{name}.cfg2.growth.prev_sample_means" for name in family_names())


def _parity_ids() -> list[str]:
    """Replay checks that are not oracle checks and not judged against a stale cached record."""
    return [c.id for c in checks.all_checks("cpu")
            if c.path == "replay" and not c.id.startswith("replay.oracle.") and c.id not in STALE_RECORD]


# ---------------------------------------------------------------------------------------- oracles


@pytest.mark.cpu
def test_flow_grpo_std_uses_sigma_max_at_sigma_one():
    sigma = torch.tensor([1.0, 0.5])
    std_t = oracles.flow_grpo_std_t64(sigma, 0.9, 0.7)
    assert std_t.dtype == torch.float64
    assert math.isclose(float(std_t[0]), 0.7 * math.sqrt(1.0 / 0.1), rel_tol=1e-12)
    assert math.isclose(float(std_t[1]), 0.7, rel_tol=1e-12)


@pytest.mark.cpu
def test_log_prob_oracle_at_the_mean_is_the_normaliser():
    mean = torch.randn(3, 2, 2, dtype=torch.float64)
    std = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    got = oracles.gaussian_log_prob64(mean, mean, std)
    want = -torch.log(std) - 0.5 * math.log(2 * math.pi)
    assert torch.allclose(got, want, rtol=0, atol=1e-15)


@pytest.mark.cpu
def test_flow_mean_oracle_reduces_to_euler_without_noise():
    x, v = torch.randn(2, 3), torch.randn(2, 3)
    sigma, nxt = torch.tensor([0.8, 0.4]), torch.tensor([0.6, 0.1])
    got = oracles.flow_mean64(x, v, sigma, nxt, torch.zeros(2))
    want = x.double() + v.double() * (nxt.double() - sigma.double()).reshape(-1, 1)
    assert torch.allclose(got, want, rtol=0, atol=1e-15)


@pytest.mark.cpu
def test_cfg_oracle_is_cond_at_scale_one_and_uncond_at_zero():
    cond, uncond = torch.randn(2, 4), torch.randn(2, 4)
    assert torch.equal(oracles.cfg_standard64(cond, uncond, 1.0), cond.double())
    assert torch.equal(oracles.cfg_standard64(cond, uncond, 0.0), uncond.double())


@pytest.mark.cpu
def test_growth_ratio_of_flat_and_growing_curves():
    assert roc.growth_ratio(torch.ones(9, dtype=torch.float64)) == 1.0
    assert roc.growth_ratio(torch.tensor([1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 4.0, 4.0, 4.0])) == 4.0
    assert roc.growth_ratio(torch.tensor([0.0, 1.0, 2.0])) == math.inf
    assert roc.growth_ratio(torch.tensor([1.0, float("nan"), 2.0])) == math.inf


# ----------------------------------------------------------------------------------- strict fakes


@pytest.mark.cpu
def test_kernel_refuses_a_row_count_that_merely_divides_the_batch():
    kernel = FakeKernel((2, 2))
    rows = {"text": torch.randn(2, 3)}
    with pytest.raises(ValueError, match=r"field 'text' has 2 rows; expected exactly 4"):
        kernel(torch.randn(4, 2, 2), torch.zeros(4), rows, {})


@pytest.mark.cpu
def test_fused_adapter_takes_a_branch_independent_field_once_per_branch_only_at_batch_rows():
    gen = torch.Generator().manual_seed(0)
    cond = fused_conditions(3, HI3_FIELDS, 2, gen, cache_uncond=False)
    adapter = FakeDenoiser(FUSED_COND_FIRST, (4, 4, 4))
    out = adapter.forward(torch.randn(6, 4, 4, 4), torch.zeros(6), cond)
    assert out.shape == (6, 4, 4, 4)
    short = Conditions(batch=3, rows={**cond.rows, "ref_latents": cond.rows["ref_latents"][:1]}, shared=cond.shared,
                       cfg_factor=2)
    with pytest.raises(ValueError, match=r"field 'ref_latents' has 1 rows; a forward of 6 rows takes exactly 6 or 3"):
        adapter.forward(torch.randn(6, 4, 4, 4), torch.zeros(6), short)


@pytest.mark.cpu
def test_fused_adapter_reads_the_uncond_branch_from_the_cache():
    """fused_uncond is arithmetic, not a label: a same-sized cache with other rows changes the output."""
    gen = torch.Generator().manual_seed(1)
    cond = fused_conditions(3, HI3_FIELDS, 2, gen)
    adapter = FakeDenoiser(FUSED_COND_FIRST, (4, 4, 4))
    hidden, t = torch.randn(6, 4, 4, 4, generator=gen), torch.zeros(6)
    reference = adapter.forward(hidden, t, cond)
    uncached = Conditions(batch=3, rows=cond.rows, shared=cond.shared, cfg_factor=2)
    assert torch.equal(adapter.forward(hidden, t, uncached), reference)
    other = {name: concat_payloads([value[1:], value[:1]]) for name, value in cond.fused_uncond.items()}
    swapped = Conditions(batch=3, rows=cond.rows, shared=cond.shared, cfg_factor=2, fused_uncond=other)
    changed = adapter.forward(hidden, t, swapped)
    assert torch.equal(changed[:3], reference[:3])
    assert not torch.equal(changed[3:], reference[3:])


# ------------------------------------------------------------------- what the oracle ablations prove


@pytest.fixture(scope="module")
def baselines(parity_session, parity_ctx):
    return unablated_check_ids("replay", parity_session, parity_ctx)


@pytest.mark.cpu
@pytest.mark.parametrize("name", SHARED)
def test_parity_survives_a_bug_in_shared_code(name, baselines, parity_ctx):
    """Stock and batched replay share the SDE step and the CFG combine: parity cannot see these bugs,
    which is why only oracle checks (and the checks that hold a family's combine to its pipeline) claim them."""
    item = ablation.get(name)
    assert all(c.startswith("replay.oracle.") or c.endswith(".cfg2.pipeline_combine") for c in item.kills), \
        f"{name} claims a parity check"
    ids = [i for i in _parity_ids() if not i.startswith(REAL_FAMILIES) or i in REAL_SAMPLE]
    if name == "replay.log_prob_floor_div":
        # floor division is discontinuous: on a model with a nonzero fp32 batch-shape floor, a mean that
        # rounds across an integer flips prev // mean, so batched and serial can differ by a whole unit
        ids = [i for i in ids if not i.startswith(REAL_FAMILIES)]
    killed = {}
    for check_id in ids:
        result = ablation.run_under(item, check_id, parity_ctx)
        if result.mode != "survived":
            killed[check_id] = result.how
    assert not killed, f"{name} (shared by stock and batched) changed parity verdicts: {killed}"


@pytest.mark.cpu
def test_compounding_drift_is_caught_by_error_growth_and_nothing_else(baselines, parity_ctx):
    item = ablation.get("replay.compounding_drift")
    assert item.kills == GROWTH
    verdicts = {check_id: ablation.run_under(item, check_id, parity_ctx) for check_id in baselines}
    killed = {c: r.how for c, r in verdicts.items() if r.mode != "survived"}
    assert set(killed) <= {*GROWTH, *GROWTH_CFG2}, killed  # the growth checks, at either cfg, and nothing else
    assert all(verdicts[check_id].killed for check_id in GROWTH)


@pytest.mark.cpu
def test_a_drift_only_a_two_branch_forward_has_fails_growth_at_cfg_2_and_only_there(baselines, parity_ctx):
    """The uncond half of the batched forward drifts (replay.uncond_drift): at cfg 1 no forward splits, so every
    cfg 1 growth check passes; at cfg 2 every family's growth check fails on the error's growth ratio."""
    item = ablation.get("replay.uncond_drift")
    assert item.kills == GROWTH_CFG2
    for check_id in GROWTH:
        assert ablation.run_under(item, check_id, parity_ctx).mode == "survived", check_id
    for check_id in GROWTH_CFG2:
        result = ablation.run_under(item, check_id, parity_ctx)
        assert result.killed and result.headline.startswith("error_growth="), (check_id, result.how, result.headline)


@pytest.mark.cpu
def test_compounding_drift_stays_under_the_single_step_tolerance(baselines):
    """On every step the drifted means are within the tolerance a worst-element check would use."""
    problem = roc.growth_problem()
    policy = roc.single_step_policy(problem)
    with ablation.get("replay.compounding_drift").apply():
        run = run_both(problem)
    verdict = judge_result(policy, run.batched.prev_sample_means,
                           run.serial.prev_sample_means, problem.target, "prev_sample_means")
    assert verdict.passed, verdict.describe()
    drift = (run.batched.prev_sample_means - run.serial.prev_sample_means).abs().flatten(2).amax(dim=(0, 2))
    assert float(drift[-1]) > float(drift[:3].max()), f"the drift must grow over the steps: {drift.tolist()}"


@pytest.mark.cpu
def test_drift_is_an_exact_no_op_on_short_stacks():
    """Up to S = 7 stacked steps the drift factor rounds to 1.0 in fp32: the bitwise checks cannot see it."""
    flat = torch.randn(7 * 2, 3)
    with ablation.get("replay.compounding_drift").apply():
        drifted = tiling.unstack_step_major(flat, 7, 2)
    assert torch.equal(drifted, flat.reshape(7, 2, 3).transpose(0, 1))
