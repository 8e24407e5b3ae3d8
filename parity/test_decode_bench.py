"""Stock vs sharded decode at W = 2 on the larger tiny VAE: wall time against the ideal 1/min(W, clips).

The stock arm is what sequence parallelism does today: every rank of the group decodes the whole
video. The sharded arm spreads the clips round-robin and all-gathers them. Both run in the same
2-rank gloo world, so dispatch and result transport cost the same in both.
"""

from __future__ import annotations

import statistics

import pytest

from fixtures import decode_models, decode_tasks
from harness.decode import plan as plan_mod

pytestmark = pytest.mark.bench

WORLD = 2
LATENTS = decode_models.LatentSpec(37, height=16, width=16)  # 7 clips of 32 x 32 pixel frames, 3 x 3 tiles each
ROUNDS = 5
_MEDIANS: dict[str, float] = {}


@pytest.mark.parametrize("mode", ["stock", "sharded"])
def test_decode_wall_time(mode, benchmark, parity_ctx, capsys):
    world = parity_ctx.world(WORLD)
    job = decode_tasks.TinyDecodeJob(LATENTS, decode_models.BENCH_VAE, shard=mode == "sharded")
    world.run(decode_tasks.decode_task, job, with_stock=False)  # warm-up: every rank builds the model once
    benchmark.group = f"decode t{LATENTS.frames} w{WORLD}"
    results = benchmark.pedantic(world.run, args=(decode_tasks.decode_task, job), kwargs={"with_stock": False},
                                 rounds=ROUNDS, iterations=1)
    _MEDIANS[mode] = benchmark.stats.stats.median
    plan = plan_mod.plan_clips(job.build_vae(), LATENTS.frames)
    clips = plan.num_clips
    ideal = 1 / min(WORLD, clips)
    with capsys.disabled():
        print(f"\n[decode bench] {mode}: world median {_MEDIANS[mode] * 1e3:.1f} ms; in-rank decode (last round) "
              f"{statistics.mean(r.seconds for r in results) * 1e3:.1f} ms; clip decodes per rank "
              f"{[r.clip_calls for r in results]} of {clips} clips")
        if {"stock", "sharded"} <= _MEDIANS.keys():
            ratio = _MEDIANS["sharded"] / _MEDIANS["stock"]
            busiest = max(len(plan_mod.owned_clips(plan, r, WORLD)) for r in range(WORLD)) / clips
            print(f"[decode bench] sharded / stock wall time = {ratio:.3f} (ideal 1/min(W={WORLD}, clips={clips}) "
                  f"= {ideal:.3f}, {ratio / ideal:.2f} x ideal; the busiest rank's clip share bounds it at "
                  f"{busiest:.3f})")
    assert len({r.sha256 for r in results}) == 1  # not a timing assertion: the arms decode the same video
