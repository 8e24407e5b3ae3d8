"""Conformance: the replay checks judge an outside replay_batched named by --impl, through the same spies."""

from __future__ import annotations

import pytest
import torch

from fixtures.replay_cases import fake_problem, real_control, real_problem
from harness.judging.compare import exact
from harness.plugins import conformance
from harness.replay.judge import compare_replay
from harness.replay.policies import local_scale_policy

pytestmark = pytest.mark.cpu


@pytest.fixture
def impl():
    spec = conformance.active("replay")
    if spec is not None:  # this test puts its own implementations under test; clear() would drop the run's
        pytest.skip(f"--impl replay={spec}: this test drives the conformance slot itself")

    def use(spec: str) -> None:
        conformance.use("replay", spec)
    yield use
    conformance.clear()


def _judge_all() -> dict[str, bool]:
    verdicts = {"fake.cfg2": compare_replay(fake_problem("cfg2"), exact(), "log_probs"),
                "fake.uncond_first": compare_replay(fake_problem("uncond_first"), exact(), "log_probs")}
    policy = local_scale_policy(real_control("flux", 2), "log_probs", torch.float32)
    verdicts["flux.cfg2"] = compare_replay(real_problem("flux", 2), policy, "log_probs")
    return {name: v.passed for name, v in verdicts.items()}


def test_a_right_outside_implementation_passes_and_is_the_one_judged(impl):
    impl("fixtures.replay_impls:branch_major")
    assert _judge_all() == {"fake.cfg2": True, "fake.uncond_first": True, "flux.cfg2": True}
    assert conformance.calls("replay") == 3


def test_an_outside_implementation_with_the_nesting_swapped_fails(impl):
    impl("fixtures.replay_impls:nesting_swapped")
    # uncond-first layouts have one branch per Conditions, so only the fused layouts can show the bug
    assert _judge_all() == {"fake.cfg2": False, "fake.uncond_first": True, "flux.cfg2": False}


def test_a_failing_replay_verdict_breaks_the_error_down_per_target_step(impl):
    impl("fixtures.replay_impls:nesting_swapped")
    problem = fake_problem("cfg2")
    verdict = compare_replay(problem, exact(), "log_probs")
    assert not verdict.passed
    steps = [part.split(":")[0] for part in verdict.metrics["max_abs_per_step"].split(", ")]
    assert steps == [f"step {s}" for s in problem.target]  # in target order, every step named
