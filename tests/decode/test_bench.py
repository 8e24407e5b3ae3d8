"""Stock vs sharded decode on the larger tiny VAE (7 clips of 3 x 3 tiles): wall time, work shares, memory held.

The stock arm is what sequence parallelism does today: every rank of the group decodes the whole
video. The sharded arm spreads the decoder work and gathers it. Wall time is measured at W = 2 (the
machine's cores) against the ideal 1/W; the busiest rank's share of the decoder forwards (tile
decodes, counted by a spy on every rank) is measured at W = 2, 4, 8 for a clip split and for the
automatic split, against 1/W; and the bytes each rank received are measured for both transports.
No assertion is timed: the work shares are counts, the wall times are only printed.
"""

from __future__ import annotations

import statistics

import pytest

from fixtures import decode_models, decode_tasks
from harness.decode import plan as plan_mod

pytestmark = [pytest.mark.bench,
              pytest.mark.skipif(decode_models.VAE_MISSING is not None, reason=str(decode_models.VAE_MISSING))]

WORLD = 2
LATENTS = decode_models.LatentSpec(37, height=16, width=16)  # 7 clips of 32 x 32 pixel frames, 3 x 3 tiles each
ROUNDS = 5
SHARE_WORLDS = (2, 4, 8)
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
    work = results[0].work
    with capsys.disabled():
        print(f"\n[decode bench] {mode}: world median {_MEDIANS[mode] * 1e3:.1f} ms; in-rank decode (last round) "
              f"{statistics.mean(r.seconds for r in results) * 1e3:.1f} ms; decoder calls per rank "
              f"{[r.decoder_calls for r in results]} of {work.decoder_calls} ({work.split} split)")
        if {"stock", "sharded"} <= _MEDIANS.keys():
            ratio = _MEDIANS["sharded"] / _MEDIANS["stock"]
            print(f"[decode bench] sharded / stock wall time = {ratio:.3f} (ideal 1/W = {1 / WORLD:.3f}, "
                  f"{ratio * WORLD:.2f} x ideal)")
    assert len({r.sha256 for r in results}) == 1  # not a timing assertion: the arms decode the same video


def test_busiest_rank_share_and_memory_held(parity_ctx, capsys):
    """Measured decoder calls per rank (a spy on every rank), per split and world; received bytes per transport."""
    rows = []
    shares: dict[tuple[int, str], float] = {}
    for world_size in SHARE_WORLDS:
        world = parity_ctx.world(world_size)
        for split in ("clips", "auto"):
            job = decode_tasks.TinyDecodeJob(LATENTS, decode_models.BENCH_VAE, split=split)
            results = world.run(decode_tasks.decode_task, job, with_stock=False)
            work = results[0].work
            calls = [r.decoder_calls for r in results]
            assert sum(calls) == work.decoder_calls  # each tile decoded exactly once across the world
            busiest = max(calls) / work.decoder_calls
            shares[(world_size, split)] = busiest
            rows.append((world_size, f"{split} -> {work.split}", work.num_units, calls, busiest,
                         busiest * world_size - 1))
    memory = []
    for transport in ("all_gather", "gather"):
        job = decode_tasks.TinyDecodeJob(LATENTS, decode_models.BENCH_VAE, transport=transport)
        results = parity_ctx.world(4).run(decode_tasks.decode_task, job, with_stock=False)
        memory.append((transport, [r.received_bytes for r in results],
                       [0 if r.output is None else r.output.numel() * r.output.element_size() for r in results]))
    with capsys.disabled():
        print(f"\n[decode bench] busiest rank's share of the decoder work, {LATENTS.frames} latent frames "
              f"({plan_mod.plan_clips(decode_models.tiny_vae(decode_models.BENCH_VAE), LATENTS.frames).num_clips} "
              "clips x 9 tiles)")
        print(f"{'W':>3} {'split':<16} {'units':>5} {'decoder calls per rank':<34} {'busiest':>8} {'1/W':>6} "
              f"{'over 1/W':>8}")
        for world_size, split, units, calls, busiest, over in rows:
            print(f"{world_size:>3} {split:<16} {units:>5} {calls!s:<34} {busiest:>8.4f} {1 / world_size:>6.4f} "
                  f"{over:>8.1%}")
        print("[decode bench] W=4 bytes received per rank (gathered pieces) / video bytes held per rank")
        for transport, received, held in memory:
            print(f"  {transport:<10} received {received}  video {held}")
    assert shares[(8, "auto")] * 8 - 1 <= 0.15  # a count, not a time: the busiest rank within 15 % of 1/8
