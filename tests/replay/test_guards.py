"""The batched replay's guards: each declines with None and replay() then answers through the serial
loop (bitwise equal to replay_serial, S forwards); cases the guards must NOT refuse still batch."""

from __future__ import annotations

import pytest
import torch

from fixtures.replay_cases import STEPS, fake_problem
from harness.replay import guards
from harness.replay.guards import ReplayConfig
from harness.replay.judge import run_batched, run_serial
from harness.replay.replay import replay
from harness.replay.sde import ConstantStdSDE, MultistepSDE
from harness.replay.spy import spy_forwards

pytestmark = pytest.mark.cpu

DECLINED = {
    "flag_off": dict(config=ReplayConfig()),
    "single_step": dict(target=(4,)),
    "stateful_solver": dict(strategy=MultistepSDE()),
    "step_varying_guidance": dict(guidance=tuple(2.0 + i for i in range(STEPS))),
}


def test_flag_is_off_by_default():
    assert ReplayConfig().batch_replay_steps is False


@pytest.mark.parametrize("name", sorted(DECLINED))
@pytest.mark.parametrize("case", ["cfg1", "cfg2", "uncond_first"])
def test_guard_declines_and_replay_falls_back_to_serial(name, case):
    problem = fake_problem(case).with_(**DECLINED[name])
    result, forwards = run_batched(problem)
    assert result is None and forwards == ()
    assert guards.fallback_reason(problem.config, problem.strategy, problem.target, problem.guidance) is not None
    expected, serial_forwards = run_serial(problem)
    with spy_forwards(problem.adapter.module) as spy:
        got = replay(problem.adapter, problem.conditions, problem.segment, problem.strategy, problem.target,
                     problem.guidance, problem.config)
    assert tuple(spy.batch_sizes) == serial_forwards == (problem.serial_rows,) * problem.steps
    assert torch.equal(got.log_probs, expected.log_probs)
    assert torch.equal(got.prev_sample_means, expected.prev_sample_means)


@pytest.mark.parametrize("change", [
    dict(strategy=ConstantStdSDE(0.4)),
    dict(guidance=(4.5,) * STEPS),
    dict(target=(6, 0)),
], ids=["constant_std_sde", "constant_schedule", "two_unsorted_targets"])
def test_guards_do_not_refuse_what_can_batch(change):
    problem = fake_problem("cfg2").with_(**change)
    assert guards.fallback_reason(problem.config, problem.strategy, problem.target, problem.guidance) is None
    result, forwards = run_batched(problem)
    expected, _ = run_serial(problem)
    assert forwards == (problem.batched_rows,)
    assert torch.equal(result.log_probs, expected.log_probs)


def test_guidance_only_matters_over_the_targets():
    """A schedule that varies elsewhere but is constant over the targets can still batch."""
    schedule = tuple(4.5 if i in (0, 3, 6) else 1.0 + i for i in range(STEPS))
    assert guards.guidance_is_constant(schedule, (0, 3, 6))
    assert not guards.guidance_is_constant(schedule, (0, 1))


def test_stateful_solver_serial_replay_consumes_step_index():
    """The refused solver is genuinely stateful: its serial replay depends on the order of steps."""
    problem = fake_problem("cfg1").with_(strategy=MultistepSDE(), target=(0, 1))
    forward, _ = run_serial(problem)
    backward, _ = run_serial(problem.with_(target=(1, 0)))
    assert not torch.equal(forward.log_probs[:, 1], backward.log_probs[:, 0])
