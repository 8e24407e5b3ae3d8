"""Fail closed beyond the catalogue's W = 8 / rank 3 cases: other ranks, sizes, splits and transports, a rank's
second piece, and faults after the probe (gather buffers, post-loop)."""

from __future__ import annotations

import pytest

from fixtures import decode_models, decode_tasks
from harness.dist import WorldTaskError
from parity import decode_checks

pytestmark = [pytest.mark.cpu,
              pytest.mark.skipif(decode_models.VAE_MISSING is not None, reason=str(decode_models.VAE_MISSING))]

CASES = [
    # (world, faulty rank, kind, latent frames, split, transport)
    (4, 0, "decoder_raises", 37, "auto", "all_gather"),  # tiles: 63 over 4
    (4, 3, "ragged_clip", 37, "clips", "all_gather"),
    (2, 1, "second_clip_raises", 37, "clips", "all_gather"),  # rank 1 owns clips 1, 3, 5
    (2, 0, "second_clip_ragged", 37, "tiles", "all_gather"),
    (3, 2, "ragged_clip", 13, "clips", "all_gather"),  # padded tail: rank 2 owns the last clip
    (8, 1, "decoder_raises", 12, "clips", "all_gather"),  # six idle ranks must raise too
    (4, 1, "gather_raises", 22, "auto", "gather"),
    (2, 0, "post_loop_raises", 22, "clips", "all_gather"),
    (3, 1, "post_loop_raises", 13, "auto", "gather"),  # only the destination (rank 1) runs the post-loop
]


@pytest.mark.parametrize(("world", "rank", "kind", "frames", "split", "transport"), CASES,
                         ids=[f"w{w}-rank{r}-{k}-t{t}-{s}-{tr}" for w, r, k, t, s, tr in CASES])
def test_every_rank_raises_together_and_the_group_survives(world, rank, kind, frames, split, transport, parity_ctx):
    job = decode_tasks.TinyDecodeJob(decode_models.LatentSpec(frames), split=split, transport=transport,
                                     dst=rank if transport == "gather" else 0)
    verdict = decode_checks.run_fault(f"decode.fault.w{world}.{kind}", parity_ctx.world(world), job, kind, rank,
                                      timeout_s=30.0)
    assert verdict.passed, verdict.describe()
    assert verdict.metrics["outcome"] == f"{world}/{world} ranks raise"


def test_an_unknown_fault_kind_is_rejected(parity_ctx):
    job = decode_tasks.TinyDecodeJob(decode_models.LatentSpec(12))
    with pytest.raises(WorldTaskError, match="fault kind must be one of"):
        parity_ctx.world(1).run(decode_tasks.fault_task, job, 0, "flaky")


def test_ranks_handed_different_latent_videos_all_raise_instead_of_a_ragged_gather(parity_ctx):
    world = parity_ctx.world(2)
    job = decode_tasks.TinyDecodeJob(decode_models.LatentSpec(22))  # 4 clips; rank 1 gets 27 frames: 5 clips
    with pytest.raises(WorldTaskError) as info:
        world.run(decode_tasks.uneven_latents_task, job, 1, 5, timeout_s=30.0)
    outcomes = info.value.outcomes
    assert [o.status for o in outcomes] == ["raised", "raised"], str(info.value)
    assert all("rank 0 planned 22 latent frames; rank 1 planned 27 latent frames" in o.error for o in outcomes)
    assert world.alive
    assert world.alive
