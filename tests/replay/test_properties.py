"""Hypothesis properties of the replay fast path over B, S, T, targets, CFG factor/layout and payloads.

On the fake kernel the batched replay must be bitwise equal to serial for every drawn problem, run
as exactly one forward of S*cfg*B rows, and reproduce the rollout's pi_old log-probs (ratio 1).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fakes.replay_conditions import HI3_FIELDS, labelled_conditions, read_labels
from fixtures.replay_cases import spec_problem
from fixtures.replay_strategies import ReplaySpec, field_specs, replay_specs
from harness.judging.compare import ulp_distance
from harness.replay import tiling
from harness.replay.conditions import payload_rows
from harness.replay.denoiser import FUSED_COND_FIRST
from harness.replay.judge import run_both
from harness.replay.sde import ConstantStdSDE, FlowGRPOSDE, as_rows, sde_step

pytestmark = pytest.mark.cpu


def _assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    assert torch.equal(actual, expected), f"{what}: max ULP {int(ulp_distance(actual, expected).max())}"


@settings(max_examples=25, deadline=None)
@given(spec=replay_specs(), constant_std=st.booleans())
def test_batched_replay_is_bitwise_serial(spec, constant_std):
    strategy = ConstantStdSDE(0.5) if constant_std else FlowGRPOSDE(0.7)
    problem = spec_problem(spec, strategy=strategy)
    run = run_both(problem)
    assert run.batched is not None, "the fast path declined a stateless, constant-guidance, S >= 2 problem"
    assert run.batched_forwards == (len(spec.target) * spec.forward_rows,)
    assert run.serial_forwards == (spec.forward_rows,) * len(spec.target)
    assert run.batched.target == spec.target
    _assert_bitwise(run.batched.log_probs, run.serial.log_probs, "log_probs")
    _assert_bitwise(run.batched.prev_sample_means, run.serial.prev_sample_means, "prev_sample_means")
    _assert_bitwise(run.batched.log_probs, problem.segment.recorded_log_probs(spec.target), "pi_old anchor")


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 4), repeats=st.integers(2, 6), fields=field_specs(),
       layout=st.sampled_from(("fused", "uncond_first", "plain")))
def test_tiled_rows_follow_branch_major_step_major(batch, repeats, fields, layout):
    """Row (branch c, step k, sample b) of the tiled batch is sample b of branch c, for every payload kind."""
    conditions = labelled_conditions(batch, fields, layout)
    tiled = tiling.tile_conditions(conditions, repeats)
    cond, uncond = list(range(batch)), [100 + b for b in range(batch)]
    for f in fields:
        value = conditions.rows[f.name]
        if layout == "fused":
            branches = [cond, uncond] if payload_rows(value) == 2 * batch else [cond, cond]
        else:
            branches = [cond]
        assert read_labels(tiled.rows[f.name]) == [x for branch in branches for x in branch * repeats], f.name
        if layout == "uncond_first":
            assert read_labels(tiled.negative.rows[f.name]) == uncond * repeats, f.name
    assert tiled.batch == batch * repeats
    assert tiled.forward_rows == conditions.branches * batch * repeats
    assert tiled.fused_uncond is None
    assert tiling.tile_conditions(conditions, 1) is conditions
    assert all(tiled.shared[k] is v for k, v in conditions.shared.items())


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 9), eta=st.floats(0.1, 1.5), at=st.integers(0, 6), seed=st.integers(0, 999))
def test_per_row_sigma_vector_matches_scalar_bitwise(rows, eta, at, seed):
    """A per-row sigma vector of equal entries computes the same bits as the scalar (one schedule step)."""
    gen = torch.Generator().manual_seed(seed)
    sigmas = torch.linspace(1.0, 0.0, 8)
    x, v = torch.randn(rows, 2, 4, 4, generator=gen), torch.randn(rows, 2, 4, 4, generator=gen)
    prev = torch.randn(rows, 2, 4, 4, generator=gen).to(torch.bfloat16)
    strategy = FlowGRPOSDE(eta)
    scalar = sde_step(strategy, x, v, sigmas[at], sigmas[at + 1], sigmas[1], trajectory_dtype=torch.bfloat16, prev=prev)
    vector = sde_step(strategy, x, v, as_rows(sigmas[at], rows).clone(), as_rows(sigmas[at + 1], rows).clone(),
                      sigmas[1], trajectory_dtype=torch.bfloat16, prev=prev)
    _assert_bitwise(vector.log_prob, scalar.log_prob, "log_prob")
    _assert_bitwise(vector.mean, scalar.mean, "mean")


def test_a_row_in_a_mixed_sigma_batch_matches_its_own_step():
    """Rows of one batch at different steps each get their own step's transition (the per-row vector)."""
    gen = torch.Generator().manual_seed(0)
    sigmas = torch.linspace(1.0, 0.0, 6)
    x, v = torch.randn(4, 2, 4, 4, generator=gen), torch.randn(4, 2, 4, 4, generator=gen)
    steps = torch.tensor([0, 2, 3, 4])
    mixed = sde_step(FlowGRPOSDE(), x, v, sigmas[steps], sigmas[steps + 1], sigmas[1], trajectory_dtype=torch.float32,
                     prev=x)
    for r, s in enumerate(steps.tolist()):
        alone = sde_step(FlowGRPOSDE(), x[r:r + 1], v[r:r + 1], sigmas[s], sigmas[s + 1], sigmas[1],
                         trajectory_dtype=torch.float32, prev=x[r:r + 1])
        _assert_bitwise(mixed.mean[r:r + 1], alone.mean, f"row {r} mean")
        _assert_bitwise(mixed.log_prob[r:r + 1], alone.log_prob, f"row {r} log_prob")


def test_sigma_one_uses_sigma_max():
    """At sigma == 1 Flow-GRPO's std_t uses s' = sigma_max = schedule[1] (no division by zero)."""
    sigma, sigma_max = torch.tensor([1.0, 0.5]), torch.tensor(0.9)
    std_t = FlowGRPOSDE(0.7).std_t(sigma, sigma_max)
    assert torch.isfinite(std_t).all()
    torch.testing.assert_close(std_t, 0.7 * torch.sqrt(torch.tensor([1.0 / 0.1, 0.5 / 0.5])))


def test_fused_layout_spec_problem_uses_fused_uncond_cache():
    """The fused cfg=2 fake conditions carry the fused_uncond cache the tiling must clear."""
    spec = ReplaySpec(2, 4, (0, 1, 2), (2, 0), 2, FUSED_COND_FIRST, HI3_FIELDS, 3)
    problem = spec_problem(spec)
    assert problem.conditions.fused_uncond is not None
    assert tiling.tile_conditions(problem.conditions, 2).fused_uncond is None
