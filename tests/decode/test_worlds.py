"""A world forked while a decode ablation is applied must not keep that ablation in its ranks.

The kill matrix restarts a torn-down world inside the next check, i.e. while that check's ablation is
applied in the parent; the forked ranks inherit the patched seam. Without harness.judging.ablation's
drop_inherited, every later task in that world would run the bug (seen here first: the W = 8 world
kept decode.rank0_clips_only after decode.shape_agreement_local tore it down).
"""

from __future__ import annotations

import pytest

from fixtures import decode_models, decode_tasks
from harness.decode import judge
from harness.judging import ablation, catalogue
from harness.process.dist import World

pytestmark = [pytest.mark.cpu,
              pytest.mark.skipif(decode_models.VAE_MISSING is not None, reason=str(decode_models.VAE_MISSING))]


def test_a_world_forked_under_an_ablation_runs_clean_tasks_clean():
    catalogue.load()
    item = ablation.get("decode.rank0_clips_only")
    job = decode_tasks.TinyDecodeJob(decode_models.LatentSpec(22))
    with item.apply():
        world = World(2).start()  # forked with the ablated collect in place
    try:
        results = world.run(decode_tasks.decode_task, job)
        verdict = judge.judge_decode(results, sharded=True)
        assert verdict.passed, verdict.describe()
        with item.apply():  # and the ablation still reaches the ranks when it is applied for a task
            broken = world.run(decode_tasks.decode_task, job)
        assert not judge.judge_decode(broken, sharded=True).passed
    finally:
        world.close()
