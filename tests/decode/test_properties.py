"""Properties of the decode path over drawn geometries (latent length, spatial size, tiling, batch, W)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fixtures import decode_models, decode_strategies, decode_tasks
from harness.decode import judge, serve
from harness.decode import plan as plan_mod

pytestmark = [pytest.mark.cpu,
              pytest.mark.skipif(decode_models.VAE_MISSING is not None, reason=str(decode_models.VAE_MISSING))]


def _stock_windows(vae, z: torch.Tensor) -> list[torch.Tensor]:
    """The latent windows the stock `_decode` hands to `_decode_clip`, in call order."""
    windows = []
    inner = vae._decode_clip

    def record(window: torch.Tensor) -> torch.Tensor:
        windows.append(window.clone())
        return inner(window)

    with serve.bound(vae, "_decode_clip", record), torch.no_grad():
        vae.decode(z)
    return windows


@settings(max_examples=20)
@given(frames=decode_strategies.latent_lengths(max_value=60))
def test_plan_matches_the_windows_the_stock_decode_asks_for(frames):
    vae = decode_models.tiny_vae(decode_models.VaeSpec(tiling=False))
    z = decode_models.latents(decode_models.LatentSpec(frames, height=2, width=2))
    plan = plan_mod.plan_clips(vae, frames)
    windows = _stock_windows(vae, z)
    padded = plan_mod.pad_latents(z, plan)
    assert len(windows) == plan.num_clips
    assert padded.shape[2] == plan.padded_latent_frames
    for clip, window in enumerate(windows):
        assert torch.equal(window, plan_mod.window_latents(padded, plan, clip)), f"clip {clip} window differs"


@given(frames=decode_strategies.latent_lengths(max_value=80), world=st.integers(min_value=1, max_value=16))
def test_round_robin_ownership_partitions_the_clips(frames, world):
    plan = plan_mod.plan_clips(decode_models.tiny_vae(), frames)
    owned = [plan_mod.owned_clips(plan, rank, world) for rank in range(world)]
    flat = sorted(c for clips in owned for c in clips)
    assert flat == list(range(plan.num_clips))
    for rank, clips in enumerate(owned):
        assert all(c % world == rank for c in clips)
    assert sum(1 for clips in owned if not clips) == max(0, world - plan.num_clips)


@settings(max_examples=10)
@given(geometry=decode_strategies.decode_geometries())
def test_sharded_decode_is_bitwise_the_stock_decode(geometry, parity_ctx):
    """Every rank's video is bitwise rank 0's stock decode, and the right path ran (spies)."""
    world = parity_ctx.world(geometry.world)
    verdict = judge.compare_sharded_decode(world, decode_tasks.decode_task, geometry.job(), sharded=geometry.world > 1,
                                           timeout_s=parity_ctx.task_timeout_s)
    assert verdict.passed, f"{geometry}\n{verdict.describe()}"
