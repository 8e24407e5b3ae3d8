"""Replay problems: the defaults the CPU and GPU tiers share and the seeded noise stream."""

from __future__ import annotations

import pytest
import torch

from harness.replay.conditions import Conditions
from harness.replay.denoiser import DenoiserAdapter
from harness.replay.guards import ReplayConfig
from harness.replay.problem import make_problem
from harness.replay.rollout import flow_sigmas
from harness.replay.sde import FlowGRPOSDE

pytestmark = pytest.mark.cpu


class _Damped(DenoiserAdapter):
    """v = -x / 2: a one-op denoiser, so a full default rollout costs next to nothing."""

    def __init__(self):
        self.module = torch.nn.Identity()

    def forward(self, hidden, timestep, conditions):
        return self.module(hidden) * -0.5


def _problem(**kwargs):
    return make_problem("p", _Damped(), Conditions(batch=2, rows={}), seed=3, latent_shape=(2,), **kwargs)


def test_make_problem_defaults_and_noise_stream():
    """T=8, SDE on (0, 1, 3, 4, 6), every SDE step replayed, CFG 4.5, Flow-GRPO eta 0.7, flag on; the noise
    is drawn from seed + 1000. Given SDE steps without a target, every one of them is replayed."""
    problem = _problem()
    segment = problem.segment
    assert (segment.num_steps, segment.sde_indices, problem.target) == (8, (0, 1, 3, 4, 6), (0, 1, 3, 4, 6))
    assert torch.equal(segment.sigmas, flow_sigmas(8))
    assert (problem.guidance, problem.strategy, problem.config) == (4.5, FlowGRPOSDE(eta=0.7), ReplayConfig(True))
    assert (problem.steps, problem.serial_rows, problem.batched_rows) == (5, 2, 10)
    assert problem.args() == (problem.adapter, problem.conditions, segment, problem.strategy, problem.target,
                              4.5, ReplayConfig(True))
    noise = torch.randn((2, 2), generator=torch.Generator().manual_seed(1003))
    assert torch.equal(segment.latent_at(0), noise.to(torch.bfloat16))
    given = _problem(sde_indices=(2, 0), steps=3, guidance=1.5)
    assert (given.target, given.segment.sde_indices, given.segment.num_steps) == ((2, 0), (2, 0), 3)
    assert given.guidance == 1.5
    assert _problem(sde_indices=(2, 0), steps=3, target=(2,)).target == (2,)
