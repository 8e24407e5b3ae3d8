"""Replay problems and rollouts: the defaults the CPU and GPU tiers share, the schedule, the rollout's
own validation, its ODE steps and its seeded noise stream."""

from __future__ import annotations

import pytest
import torch

from fixtures.replay_cases import BATCH, FAKE_LATENT, fake_problem
from harness.replay.denoiser import predict_velocity
from harness.replay.guards import ReplayConfig
from harness.replay.problem import make_problem
from harness.replay.rollout import flow_sigmas, rollout
from harness.replay.sde import FlowGRPOSDE, MultistepSDE

pytestmark = pytest.mark.cpu


def _fake(**kwargs):
    base = fake_problem("cfg1")
    return make_problem("p", base.adapter, base.conditions, seed=3, latent_shape=FAKE_LATENT, **kwargs)


def test_make_problem_defaults_are_the_shared_geometry():
    """T=8, SDE on (0, 1, 3, 4, 6), every SDE step replayed, CFG 4.5, Flow-GRPO eta 0.7, flag on."""
    problem = _fake()
    segment = problem.segment
    assert (segment.num_steps, segment.sde_indices, problem.target) == (8, (0, 1, 3, 4, 6), (0, 1, 3, 4, 6))
    assert torch.equal(segment.sigmas, flow_sigmas(8))
    assert (problem.guidance, problem.strategy, problem.config) == (4.5, FlowGRPOSDE(eta=0.7), ReplayConfig(True))
    assert (problem.steps, problem.serial_rows, problem.batched_rows) == (5, BATCH, 5 * BATCH)
    assert problem.args() == (problem.adapter, problem.conditions, segment, problem.strategy, problem.target,
                              4.5, ReplayConfig(True))


def test_make_problem_noise_comes_from_seed_plus_1000():
    noise = torch.randn((BATCH, *FAKE_LATENT), generator=torch.Generator().manual_seed(1003))
    assert torch.equal(_fake().segment.latent_at(0), noise.to(torch.bfloat16))


def test_make_problem_replays_every_given_sde_step_by_default():
    problem = _fake(sde_indices=(2, 0), steps=3, guidance=1.5)
    assert (problem.target, problem.segment.sde_indices, problem.segment.num_steps) == ((2, 0), (2, 0), 3)
    assert problem.guidance == 1.5
    assert _fake(sde_indices=(2, 0), steps=3, target=(2,)).target == (2,)


def test_flow_sigmas_shift_the_linear_schedule():
    assert flow_sigmas(1).tolist() == [1.0, 0.0]
    assert flow_sigmas(2).tolist() == [1.0, 0.75, 0.0]  # 3 * 0.5 / (1 + 2 * 0.5)
    assert flow_sigmas(4, shift=1.0).tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert flow_sigmas(2).dtype == torch.float32


@pytest.mark.parametrize(("steps", "shift", "match"), [
    (0, 3.0, "a schedule needs at least one step, got 0"),
    (-2, 3.0, "a schedule needs at least one step, got -2"),
    (4, 0.0, "shift must be > 0, got 0.0"),
    (4, -1.0, "shift must be > 0, got -1.0"),
])
def test_flow_sigmas_refuse_bad_schedules(steps, shift, match):
    with pytest.raises(ValueError, match=match):
        flow_sigmas(steps, shift)


def _rollout(strategy, sde_indices, steps=8, **kwargs):
    base = fake_problem("cfg1")
    return rollout(base.adapter, base.conditions, strategy, flow_sigmas(steps), sde_indices, FAKE_LATENT,
                   generator=torch.Generator().manual_seed(5), guidance=2.0, **kwargs)


@pytest.mark.parametrize("sde", [(0, 8), (-1, 3), (2, 2)])
def test_rollout_refuses_sde_steps_outside_the_schedule_or_repeated(sde):
    with pytest.raises(ValueError, match=rf"sde_indices \[{sde[0]}, {sde[1]}\] must be distinct steps in \[0, 7\]"):
        _rollout(FlowGRPOSDE(), sde)


def test_rollout_takes_euler_steps_between_sde_steps():
    """Steps 1 and 2 are ODE steps: x_(i+1) = x_i + v(x_i, sigma_i) (sigma_(i+1) - sigma_i), fp64 here."""
    base = fake_problem("cfg1")
    segment = _rollout(FlowGRPOSDE(), (0, 3), steps=4, trajectory_dtype=torch.float32)
    assert segment.latent_steps == (0, 1, 3, 4)
    sigmas = flow_sigmas(4).double()
    x = segment.latent_at(1).double()
    for step in (1, 2):
        v = predict_velocity(base.adapter, x.float(), float(sigmas[step]), base.conditions, 2.0).double()
        x = x + v * (sigmas[step + 1] - sigmas[step])
    torch.testing.assert_close(segment.latent_at(3).double(), x, rtol=1e-6, atol=1e-6)


def test_rollout_forgets_a_stateful_strategy_history():
    """A strategy reused from an earlier rollout must not extrapolate from that rollout's velocities."""
    used = MultistepSDE()
    _rollout(used, (2, 3))
    again, fresh = _rollout(used, (3,)), _rollout(MultistepSDE(), (3,))
    assert torch.equal(again.latents, fresh.latents) and torch.equal(again.log_probs, fresh.log_probs)
