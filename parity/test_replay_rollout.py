"""The rollout on the fake kernel: its refusal of bad SDE steps, its Euler steps between SDE steps, and
a stateful solver's history forgotten between rollouts."""

from __future__ import annotations

import pytest
import torch

from fixtures.replay_cases import FAKE_LATENT, fake_problem
from harness.replay.denoiser import predict_velocity
from harness.replay.rollout import flow_sigmas, rollout
from harness.replay.sde import FlowGRPOSDE, MultistepSDE

pytestmark = pytest.mark.cpu


def _rollout(strategy, sde_indices, steps=8, **kwargs):
    base = fake_problem("cfg1")
    return rollout(base.adapter, base.conditions, strategy, flow_sigmas(steps), sde_indices, FAKE_LATENT,
                   generator=torch.Generator().manual_seed(5), guidance=2.0, **kwargs)


def test_rollout_refuses_sde_steps_outside_the_schedule_or_repeated():
    for sde in ((0, 8), (-1, 3), (2, 2)):
        with pytest.raises(ValueError, match=rf"sde_indices \[{sde[0]}, {sde[1]}\] must be distinct steps in \[0, 7\]"):
            _rollout(FlowGRPOSDE(), sde)


def test_rollout_takes_euler_steps_between_sde_steps_and_forgets_solver_state():
    """Steps 1 and 2 are ODE steps: x_(i+1) = x_i + v(x_i, sigma_i) (sigma_(i+1) - sigma_i), fp64 here.
    The solver comes from an earlier rollout: step 3 must not extrapolate from that rollout's step 2."""
    used = MultistepSDE()
    _rollout(used, (2, 3))
    segment = _rollout(used, (0, 3), steps=4, trajectory_dtype=torch.float32)
    fresh = _rollout(MultistepSDE(), (0, 3), steps=4, trajectory_dtype=torch.float32)
    assert torch.equal(segment.latents, fresh.latents) and torch.equal(segment.log_probs, fresh.log_probs)
    assert segment.latent_steps == (0, 1, 3, 4)
    base = fake_problem("cfg1")
    sigmas = flow_sigmas(4).double()
    x = segment.latent_at(1).double()
    for step in (1, 2):
        v = predict_velocity(base.adapter, x.float(), float(sigmas[step]), base.conditions, 2.0).double()
        x = x + v * (sigmas[step + 1] - sigmas[step])
    torch.testing.assert_close(segment.latent_at(3).double(), x, rtol=1e-6, atol=1e-6)
