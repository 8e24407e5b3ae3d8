"""Decode guards no end-to-end run reaches: the sharded path is opt-in, latents that do not fit a plan are refused,
a tile server asked to serve a plan without tiles refuses it cleanly, and a plan that names fewer frames than the
library decoded never passes."""

from __future__ import annotations

import pytest
import torch

from fixtures import decode_models
from harness.decode import oracle, serve, sharded
from harness.decode import plan as plan_mod
from harness.decode.exchange import ShardedDecodeError

pytestmark = [pytest.mark.cpu,
              pytest.mark.skipif(decode_models.VAE_MISSING is not None, reason=str(decode_models.VAE_MISSING))]


def test_the_sharded_path_is_opt_in(monkeypatch):
    asked = []

    def takes_sharded_path(enabled, group):
        asked.append(enabled)
        return False

    monkeypatch.setattr(sharded, "takes_sharded_path", takes_sharded_path)
    vae = decode_models.tiny_vae()
    z = decode_models.latents(decode_models.LatentSpec(9, height=2, width=2))
    sharded.decode_video(vae, z)
    assert asked == [False]  # a call that does not ask for sharding gets the stock decode


@pytest.mark.parametrize("frames", [8, 10])
def test_latents_that_do_not_fit_the_plan_are_refused(frames):
    plan = plan_mod.plan_clips(decode_models.tiny_vae(), 9)
    with pytest.raises(ValueError, match="do not match a plan for 9 latent frames"):
        plan_mod.pad_latents(torch.zeros(1, 4, frames, 2, 2), plan)
    with pytest.raises(ValueError, match="do not match a plan for 9 latent frames"):
        plan_mod.pad_latents(torch.zeros(4, 9, 2, 2), plan)


def test_a_tile_server_refuses_a_plan_without_tiles_even_with_the_right_count():
    vae = decode_models.tiny_vae()
    work = plan_mod.WorkPlan(plan_mod.plan_clips(vae, 12), None, "clips")
    padded = torch.zeros(1, 4, 14, 8, 8)
    with pytest.raises(ShardedDecodeError, match="refusing to run the post-loop"), \
            serve.serve_tiles(vae, padded, work, [torch.zeros(1)] * work.num_units):
        pass


def test_a_plan_naming_fewer_frames_than_the_library_decoded_never_passes(monkeypatch):
    z = decode_models.latents(decode_models.LatentSpec(9, height=2, width=2))
    sources = plan_mod.frame_sources
    monkeypatch.setattr(plan_mod, "frame_sources", lambda plan, frames: sources(plan, frames)[:-1])
    try:
        verdict = oracle.judge_plan_against_library([(decode_models.tiny_vae(), z)])
    except ValueError:  # the frame lists cannot even be paired
        return
    assert not verdict.passed, verdict.describe()


def test_the_stock_encode_refuses_what_is_not_the_vae_before_reading_its_config():
    from types import SimpleNamespace

    lookalike = SimpleNamespace(config=SimpleNamespace(in_channels=3), encode=lambda x: None)
    with pytest.raises(TypeError, match="expected an AutoencoderKLMiniMaxH3 .* got SimpleNamespace"):
        sharded.stock_encode(lookalike, torch.zeros(1, 3, 5, 8, 8))


def test_a_piece_server_asked_for_one_call_too_many_names_it():
    server = serve.PieceServer(lambda index: torch.full((2,), float(index)), [torch.zeros(1), torch.ones(1)], "probe")
    assert float(server(torch.full((2,), 0.0))) == 0.0 and float(server(torch.full((2,), 1.0))) == 1.0
    with pytest.raises(ShardedDecodeError, match="asked probe for piece 2 but only 2 were gathered"):
        server(torch.full((2,), 2.0))
