"""A bug in the stock path that the batch-shape control shares: its floor is the bug's size, above the ceiling the
arithmetic allows, and the check fails saying the stock path depends on the batch composition.

The adapter below keeps a per-row field (SD3's pooled projections) as if it were shared and fills the forward's
rows with ``repeat``: right at one serial forward's rows, interleaved wrong once S steps are stacked on the batch.
The control runs the same adapter at the fast path's shape, so without a ceiling it measures the bug as noise and
widens the bound until the check passes.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fixtures.replay_models import tiny_model
from harness.replay.controls import measure_batch_shape_control
from harness.replay.families import get_family
from harness.replay.families.sd3 import SD3Adapter
from harness.replay.judge import compare_replay
from harness.replay.policies import local_scale_policy
from harness.replay.problem import make_problem

pytestmark = pytest.mark.cpu

BATCH = 3


class PooledSharedAdapter(SD3Adapter):
    """Reads the pooled projections of one serial forward, ``[uncond_B; cond_B]``, from a shared field and repeats
    them to the forward's row count."""

    def forward(self, hidden, timestep, conditions):
        both = conditions.shared["pooled_both"]
        rows = {**conditions.rows, "pooled_projections": both.repeat(hidden.shape[0] // both.shape[0], 1)}
        return super().forward(hidden, timestep, dataclasses.replace(conditions, rows=rows))


def _conditions(adapter):
    return get_family("sd3").example_conditions(adapter, BATCH, 2, torch.Generator().manual_seed(22))


@pytest.fixture(scope="module")
def buggy_problem():
    adapter = PooledSharedAdapter(tiny_model("sd3"))
    cond = _conditions(adapter)
    both = torch.cat([cond.negative.rows["pooled_projections"], cond.rows["pooled_projections"]])
    negative = dataclasses.replace(cond.negative, shared={**cond.negative.shared, "pooled_both": both})
    cond = dataclasses.replace(cond, shared={**cond.shared, "pooled_both": both}, negative=negative)
    return make_problem("sd3.pooled_shared", adapter, cond, seed=2, latent_shape=adapter.latent_shape)


def test_a_stock_path_bug_the_control_shares_fails_on_its_ceiling_not_within_a_widened_bound(buggy_problem):
    control = measure_batch_shape_control(buggy_problem)
    for what in ("log_probs", "prev_sample_means"):
        policy = local_scale_policy(control, what, torch.float32)
        floor = policy.stock_floor
        assert floor.above_ceiling and floor.measured > 100 * floor.ceiling, floor.describe()
        verdict = compare_replay(buggy_problem, policy, what)
        assert not verdict.passed
        assert verdict.violated_facts[0].startswith("the stock path itself depends on the batch composition"), \
            verdict.violated_facts
        # the hole this closes: the bound the measured "floor" gives is wide enough for the bug itself, so its
        # numbers pass (margin <= 1) and only the ceiling fails it
        assert verdict.margin <= 1 and len(verdict.violated_facts) == 1, verdict.describe()
        assert policy.relative_bound > 10 * floor.ceiling and math.isfinite(policy.relative_bound)


def test_the_correct_adapter_measures_rounding_far_below_its_ceiling():
    adapter = SD3Adapter(tiny_model("sd3"))
    problem = make_problem("sd3.correct", adapter, _conditions(adapter), seed=2, latent_shape=adapter.latent_shape)
    control = measure_batch_shape_control(problem)
    for what in ("log_probs", "prev_sample_means"):
        policy = local_scale_policy(control, what, torch.float32)
        assert not policy.stock_floor.above_ceiling, policy.stock_floor.describe()
        assert compare_replay(problem, policy, what).passed


def test_the_repeat_bug_fails_with_a_users_replay_in_conformance_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The catalogue's ablation of the same bug (replay.sd3_pooled_repeated) under ``--impl replay=...``: the
    user's batched replay is judged against the suite's stock path, whose control shares the bug and fails on its
    ceiling, not within a widened bound."""
    from pathlib import Path

    from harness.judging import ablation, catalogue, checks
    from harness.judging.checks import CheckContext
    from harness.plugins import conformance

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples" / "conformance"))
    catalogue.load()
    check_id = "replay.sd3.cfg2.log_probs"
    with conformance.applied({"replay": "zoo_replay:replay_batched"}):
        before = conformance.calls("replay")
        with ablation.get("replay.sd3_pooled_repeated").apply():
            verdict = checks.run_check(check_id, CheckContext())
        assert conformance.calls("replay") > before, "the user's implementation was never called"
    assert not verdict.passed and verdict.margin is not None and verdict.margin <= 1.0, verdict.describe()
    assert any("the stock path itself depends on the batch composition" in f for f in verdict.violated_facts)
