"""The sharded decode on the larger tiny VAE (7 clips of 3 x 3 tiles): the busiest rank's share of the stock
decode beside the 1/W ideal and the raw limit, at W = 2, 4, 8, split by clips and by (clip, tile) pairs.

Each item starts a W-rank world and runs ``fixtures.decode_bench.decode_bench_task``: the ranks take their decoder
work in turns, the busiest rank last and alone, so its time is its own even where W exceeds the machine's cores.
``stock`` is the whole decode (what every rank does today), ``raw`` the VAE's own decode of the busiest rank's
pieces (nothing exchanged), ``fast`` the busiest rank's sharded call, whose exchange and post-loop are shown on
their own. A second table counts the decoder work per rank (a spy on every rank) and the bytes each rank receives
per transport. The only assertions are counts and bit equality; times are printed and reported.
"""

from __future__ import annotations

from typing import Any

import pytest

from fixtures import decode_models, decode_tasks
from fixtures.bench_timing import bench_rounds
from fixtures.decode_bench import DecodeBenchJob, decode_bench_task
from harness.decode import plan as plan_mod

pytestmark = [pytest.mark.bench,
              pytest.mark.skipif(decode_models.VAE_MISSING is not None, reason=str(decode_models.VAE_MISSING))]

LATENTS = decode_models.LatentSpec(37, height=16, width=16)  # 7 clips of 32 x 32 pixel frames, 3 x 3 tiles each
WORLDS = (2, 4, 8)
SPLITS = ("clips", "tiles")
ROUNDS = bench_rounds(3)
TITLE = (f"decode: the busiest rank's sharded call (fast) vs the stock decode of the whole video, "
         f"{LATENTS.frames} latent frames, fp32 CPU, one thread per rank, best of {ROUNDS}; raw = the VAE's own "
         "decode of the busiest rank's pieces, no exchange; ideal 1/W; ranks decode in turns, the busiest alone")
WORK_TITLE = (f"decode work per rank (decoder calls counted on every rank), {LATENTS.frames} latent frames; "
              "auto = the split the plan picks")
MEMORY_TITLE = "decode at W=4: bytes each rank receives (gathered pieces) and video bytes it holds, per transport"


@pytest.fixture(params=WORLDS, ids=[f"w{w}" for w in WORLDS])
def world_size(request: pytest.FixtureRequest) -> int:
    """Parametrized fixtures, not parametrize marks: the marks' keyword "parametrize" would match ``-k ar``."""
    return request.param


@pytest.fixture(params=SPLITS)
def split(request: pytest.FixtureRequest) -> str:
    return request.param


def test_decode_busiest_rank(bench_log: Any, parity_ctx: Any, world_size: int, split: str) -> None:
    job = DecodeBenchJob(LATENTS, decode_models.BENCH_VAE, split, ROUNDS)
    results = parity_ctx.world(world_size).run(decode_bench_task, job, timeout_s=600.0)
    measured = [r for r in results if r is not None]
    assert len(measured) == 1, "exactly one rank (the busiest) times the arms"
    times = measured[0]
    assert times.same_video, "the sharded video must be the stock one before its time means anything"
    assert sum(times.units_per_rank) == times.num_units  # each piece decoded exactly once across the world
    unit = "clips" if times.split == "clips" else "tiles"
    bench_log.record("decode", TITLE, {"W": world_size, "split": "clips" if split == "clips" else "clips x tiles"},
                     ideal=1 / world_size, fast=times.fast_s, stock=times.stock_s, raw=times.raw_s,
                     extra={"busiest rank": f"{max(times.units_per_rank)}/{times.num_units} {unit}",
                            "pieces ms": times.pieces_s * 1e3, "exchange ms": times.exchange_s * 1e3,
                            "post-loop ms": times.post_loop_s * 1e3})


def test_decoder_calls_per_rank_and_memory_held(bench_log: Any, parity_ctx: Any) -> None:
    """Measured decoder calls per rank (a spy on every rank), per split and world; received bytes per transport."""
    vae = decode_models.tiny_vae(decode_models.BENCH_VAE)
    shares: dict[tuple[int, str], float] = {}
    for world_size in WORLDS:
        world = parity_ctx.world(world_size)
        for split in ("clips", "auto"):
            job = decode_tasks.TinyDecodeJob(LATENTS, decode_models.BENCH_VAE, split=split)
            results = world.run(decode_tasks.decode_task, job, with_stock=False)
            work = results[0].work
            calls = [r.decoder_calls for r in results]
            assert sum(calls) == work.decoder_calls  # each tile decoded exactly once across the world
            busiest = max(calls) / work.decoder_calls
            shares[(world_size, split)] = busiest
            bench_log.record("decode.work", WORK_TITLE, {"W": world_size, "split": f"{split} -> {work.split}"},
                             extra={"units": work.num_units, "decoder calls per rank": str(calls),
                                    "busiest": busiest, "1/W": 1 / world_size, "over 1/W": busiest * world_size - 1})
    for transport in ("all_gather", "gather"):
        job = decode_tasks.TinyDecodeJob(LATENTS, decode_models.BENCH_VAE, transport=transport)
        results = parity_ctx.world(4).run(decode_tasks.decode_task, job, with_stock=False)
        bench_log.record("decode.memory", MEMORY_TITLE, {"transport": transport},
                         extra={"received per rank": str([r.received_bytes for r in results]),
                                "video per rank": str([0 if r.output is None else r.output.numel()
                                                       * r.output.element_size() for r in results])})
    clips = plan_mod.plan_clips(vae, LATENTS.frames).num_clips
    assert clips == 7, "the bench geometry: 7 clips"
    assert shares[(8, "auto")] * 8 - 1 <= 0.15  # a count, not a time: the busiest rank within 15 % of 1/8
