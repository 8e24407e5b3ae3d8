"""The sigma schedule, and the rollout on a one-op denoiser: its refusal of bad SDE steps, its Euler
steps between SDE steps, and a stateful solver's history forgotten between rollouts."""

from __future__ import annotations

import re

import pytest
import torch

from harness.replay.conditions import Conditions
from harness.replay.denoiser import UNGUIDED_CFG, DenoiserAdapter
from harness.replay.replay import replay_serial
from harness.replay.rollout import flow_sigmas, rollout
from harness.replay.sde import FlowGRPOSDE, MultistepSDE

pytestmark = pytest.mark.cpu


class _Curl(DenoiserAdapter):
    """v = (x rolled by one) - x / 2 + t / 1000: depends on the row's state and its sigma, costs next to nothing."""

    def __init__(self):
        self.module = torch.nn.Identity()

    def forward(self, hidden, timestep, conditions):
        return self.module(hidden).roll(1, dims=1) - 0.5 * hidden + timestep.reshape(-1, 1) / 1000.0


def _rollout(strategy, sde_indices, steps=8, **kwargs):
    return rollout(_Curl(), Conditions(batch=2, rows={}), strategy, flow_sigmas(steps), sde_indices, (3,),
                   generator=torch.Generator().manual_seed(5), **kwargs)


def test_schedule_and_rollout_refusals():
    """The shifted flow schedule (and its refusals); SDE steps outside it, repeated or none are refused."""
    assert flow_sigmas(1).tolist() == [1.0, 0.0]
    assert flow_sigmas(2).tolist() == [1.0, 0.75, 0.0]  # 3 * 0.5 / (1 + 2 * 0.5)
    assert flow_sigmas(4, shift=1.0).tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert flow_sigmas(2).dtype == torch.float32
    for steps, shift, message in ((0, 3.0, "a schedule needs at least one step, got 0"),
                                  (-2, 3.0, "a schedule needs at least one step, got -2"),
                                  (4, 0.0, "shift must be > 0, got 0.0"), (4, -1.0, "shift must be > 0, got -1.0")):
        with pytest.raises(ValueError, match=message):
            flow_sigmas(steps, shift)
    for sde in ((0, 8), (-1, 3), (2, 2), ()):
        with pytest.raises(ValueError, match=re.escape(f"sde_indices {list(sde)} must be distinct steps in [0, 7] "
                                                       "(at least one)")):
            _rollout(FlowGRPOSDE(), sde)


def test_rollout_takes_euler_steps_between_sde_steps_and_forgets_solver_state():
    """Steps 1 and 2 are ODE steps: x_(i+1) = x_i + v(x_i, sigma_i) (sigma_(i+1) - sigma_i), fp64 here.
    The solver comes from an earlier rollout: step 3 must not extrapolate from that rollout's step 2.
    Replaying the stored steps recomputes the recorded log-probs exactly (step 0 uses s' = sigmas[1])."""
    used = MultistepSDE()
    _rollout(used, (2, 3))
    segment = _rollout(used, (0, 3), steps=4, trajectory_dtype=torch.float32)
    fresh = _rollout(MultistepSDE(), (0, 3), steps=4, trajectory_dtype=torch.float32)
    assert torch.equal(segment.latents, fresh.latents) and torch.equal(segment.log_probs, fresh.log_probs)
    assert segment.latent_steps == (0, 1, 3, 4)
    sigmas = flow_sigmas(4).double()
    x = segment.latent_at(1).double()
    for step in (1, 2):
        v = x.roll(1, dims=1) - 0.5 * x + sigmas[step]
        x = x + v * (sigmas[step + 1] - sigmas[step])
    assert torch.allclose(segment.latent_at(3).double(), x, rtol=1e-6, atol=1e-6)
    assert _rollout(FlowGRPOSDE(), (1,), steps=2).latent_steps == (1, 2)  # x_0 is kept only for step 0
    flow = _rollout(FlowGRPOSDE(), (0, 3), steps=4)
    replayed = replay_serial(_Curl(), Conditions(batch=2, rows={}), flow, FlowGRPOSDE(), (0, 3))
    assert torch.equal(replayed.log_probs, flow.log_probs)


def test_a_guided_rollout_needs_a_guidance_scale():
    """Left out, guidance is refused for CFG conditions, as replay refuses it: no silent cond-only combine."""
    guided = Conditions(batch=2, rows={}, cfg_factor=2)
    with pytest.raises(ValueError, match=re.escape(UNGUIDED_CFG)):
        rollout(_Curl(), guided, FlowGRPOSDE(), flow_sigmas(2), (0,), (3,), generator=torch.Generator().manual_seed(5))
    segment = rollout(_Curl(), guided, FlowGRPOSDE(), flow_sigmas(2), (0,), (3,),
                      generator=torch.Generator().manual_seed(5), guidance=1.0)
    assert segment.latent_steps == (0, 1)
