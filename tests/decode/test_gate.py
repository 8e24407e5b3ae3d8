"""The opt-in gate and the stock fallback (spies), the clip server's guards, and bad-input errors."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from fixtures import decode_models, decode_tasks
from harness.decode import exchange, judge, serve, sharded
from harness.decode import plan as plan_mod
from harness.decode.exchange import Probe, ProbeStatus, ShardedDecodeError

pytestmark = [pytest.mark.cpu,
              pytest.mark.skipif(decode_models.VAE_MISSING is not None, reason=str(decode_models.VAE_MISSING))]


@contextlib.contextmanager
def _spy_stock_call(vae) -> Iterator[dict[str, int]]:
    """Count `decode` calls, real clip decodes, and clip decodes made under a rebound `_decode`."""
    seen = {"decode": 0, "clip": 0, "clip_under_rebound_decode": 0}
    decode, clip = vae.decode, vae._decode_clip

    def spy_decode(*args, **kwargs):
        seen["decode"] += 1
        return decode(*args, **kwargs)

    def spy_clip(window):
        seen["clip"] += 1
        seen["clip_under_rebound_decode"] += "_decode" in vae.__dict__
        return clip(window)

    with serve.bound(vae, "decode", spy_decode), serve.bound(vae, "_decode_clip", spy_clip):
        yield seen


def _tiny() -> tuple[object, torch.Tensor]:
    vae = decode_models.tiny_vae()
    return vae, decode_models.latents(decode_models.LatentSpec(37))


def test_flag_defaults_to_off_and_takes_exactly_the_stock_call():
    vae, z = _tiny()
    with torch.no_grad():
        expected = vae.decode(z).sample
        with _spy_stock_call(vae) as seen:
            out = sharded.decode_video(vae, z)
    assert torch.equal(out, expected)
    assert seen == {"decode": 1, "clip": 7, "clip_under_rebound_decode": 0}


def test_no_initialised_group_takes_the_stock_call_even_with_the_flag_on():
    assert not dist.is_initialized()
    vae, z = _tiny()
    with torch.no_grad():
        expected = vae.decode(z).sample
        with _spy_stock_call(vae) as seen:
            out = sharded.decode_video(vae, z, shard_across_group=True)
    assert torch.equal(out, expected)
    assert seen == {"decode": 1, "clip": 7, "clip_under_rebound_decode": 0}
    assert "_decode" not in vae.__dict__ and "_decode_clip" not in vae.__dict__


def test_sharded_decode_without_a_group_is_a_clear_error():
    vae, z = _tiny()
    with pytest.raises(ValueError, match="initialised torch.distributed process group"):
        sharded.sharded_decode(vae, z, None)


@pytest.mark.parametrize("shard", [True, False])
def test_world_of_one_and_flag_off_take_the_stock_call_in_a_group(shard, parity_ctx):
    """W == 1 with the flag on, and W == 2 with it off: no collective, every rank decodes every clip."""
    world = parity_ctx.world(1 if shard else 2)
    job = decode_tasks.TinyDecodeJob(decode_models.LatentSpec(22), shard=shard)
    results = world.run(decode_tasks.decode_task, job)
    assert [r.collectives for r in results] == [{}] * world.size
    assert [r.clip_calls for r in results] == [4] * world.size
    assert {r.sha256 for r in results} == {results[0].stock_sha256}


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda z: z[0], r"\(batch, channels, frames, height, width\), got \(4, 37, 8, 8\)"),
        (lambda z: z[:, :3], "latents have 3 channels but the VAE takes 4"),
        (lambda z: z.long(), "must be a float tensor"),
    ],
    ids=["4d", "channels", "int"],
)
def test_bad_latents_are_rejected_naming_what_was_expected(make, match):
    vae, z = _tiny()
    for entry in (sharded.decode_video, sharded.stock_decode, functools.partial(sharded.sharded_decode, group=None)):
        with pytest.raises(ValueError, match=match):
            entry(vae, make(z))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda x: x[0],
         r"videos must be a float tensor \(batch, channels, frames, height, width\), got \(3, 5, 4, 4\)"),
        (lambda x: x[:, :2], r"videos have 2 channels but the VAE takes 3 .* expected \(batch, 3, frames"),
        (lambda x: x.long(), "videos must be a float tensor"),
    ],
    ids=["4d", "channels", "int"],
)
def test_bad_videos_are_rejected_by_both_encode_entries_before_any_group_check(make, match):
    vae = decode_models.tiny_vae()
    video = torch.zeros(1, vae.config.in_channels, 5, 4, 4)
    for entry in (sharded.stock_encode, functools.partial(sharded.sharded_encode, group=None)):
        with pytest.raises(ValueError, match=match):
            entry(vae, make(video))


def test_sharded_encode_without_a_group_is_a_clear_error():
    vae = decode_models.tiny_vae()
    video = torch.zeros(1, vae.config.in_channels, 5, 4, 4)
    with pytest.raises(ValueError, match="the sharded decode/encode needs an initialised torch.distributed process "
                                         "group; decode_video falls back"):
        sharded.sharded_encode(vae, video, None)


def test_a_video_too_short_for_one_clip_is_rejected_by_the_plan():
    vae = decode_models.tiny_vae()
    with pytest.raises(ValueError, match="2 frames holds no whole clip .* needs at least 3 latent frames"):
        plan_mod.plan_clips(vae, 2)
    with pytest.raises(ValueError, match="positive int"):
        plan_mod.plan_clips(vae, 0)


def test_not_a_minimax_vae_and_a_non_bool_flag_are_type_errors():
    _, z = _tiny()
    with pytest.raises(TypeError, match="AutoencoderKLMiniMaxH3"):
        sharded.decode_video(torch.nn.Linear(2, 2), z)
    with pytest.raises(TypeError, match="shard_across_group must be a bool"):
        sharded.decode_video(decode_models.tiny_vae(), z, shard_across_group="yes")


def test_plan_rejects_a_model_whose_derived_geometry_disagrees_with_its_config():
    vae = decode_models.tiny_vae()
    with serve.bound(vae, "token_overlap", 3), pytest.raises(ValueError, match="token_overlap is 3"):
        plan_mod.plan_clips(vae, 37)


def test_seed_geometry_names():
    plan = plan_mod.plan_clips(decode_models.tiny_vae(), 37)
    assert (plan.tokens_chunk_size, plan.token_overlap, plan.frame_pre_padding, plan.frame_overlap) == (5, 2, 3, 5)
    assert (plan.num_clips, plan.pad_tokens, plan.window(6)) == (7, 0, (30, 37))
    assert [plan_mod.plan_clips(decode_models.tiny_vae(), t).num_clips for t in (22, 12, 13, 3)] == [4, 2, 3, 1]
    with pytest.raises(ValueError, match="clip 7 is outside"):
        plan.window(7)
    with pytest.raises(ValueError, match="rank 4 is not in a world of 4"):
        plan_mod.owned_clips(plan, 4, 4)


def test_clip_server_refuses_a_window_the_plan_did_not_decode():
    vae, z = _tiny()
    plan = plan_mod.plan_clips(vae, 37)
    padded = plan_mod.pad_latents(z, plan)
    clips = [torch.zeros(1) for _ in range(plan.num_clips)]
    server = serve.ClipServer(padded, plan, clips)
    assert server(plan_mod.window_latents(padded, plan, 0)) is clips[0]
    with pytest.raises(ShardedDecodeError, match=r"_decode_clip call 1 passed an input .* not the planned one"):
        server(plan_mod.window_latents(padded, plan, 2))
    with pytest.raises(ShardedDecodeError, match="used 1 of the 7 gathered pieces"):
        server.finish()
    with pytest.raises(ShardedDecodeError, match="8 clips were gathered for a plan of 7"):
        serve.ClipServer(padded, plan, [*clips, clips[0]])


def test_bound_restores_what_the_instance_held_before():
    vae = decode_models.tiny_vae()
    with serve.bound(vae, "_decode_clip", len):
        with serve.bound(vae, "_decode_clip", abs):
            assert vae._decode_clip is abs
        assert vae._decode_clip is len
    assert "_decode_clip" not in vae.__dict__


def _probe(rank, status=ProbeStatus.OK, count=1, shape=(1, 3, 28, 16, 16), dtype=torch.float32):
    return Probe(rank, status, count, dtype if count else None, shape if count else ())


def test_agreement_is_derived_from_every_probe():
    ok = [_probe(0), _probe(1), _probe(2, count=0)]
    assert exchange.agree_on_shapes(ok, 2) == ((1, 3, 28, 16, 16), torch.float32)
    with pytest.raises(ShardedDecodeError, match=r"rank 1: its clip decoder raised"):
        exchange.agree_on_shapes([_probe(0), _probe(1, ProbeStatus.DECODER_RAISED, 0)], 0)
    with pytest.raises(ShardedDecodeError, match=r"rank 1 decoded clips of \(1, 3, 27, 16, 16\)"):
        exchange.agree_on_shapes([_probe(0), _probe(1, shape=(1, 3, 27, 16, 16))], 0)
    with pytest.raises(ShardedDecodeError, match="bfloat16"):
        exchange.agree_on_shapes([_probe(0), _probe(1, dtype=torch.bfloat16)], 1)
    with pytest.raises(ShardedDecodeError, match="rank 1 planned 22 latent frames"):
        exchange.agree_on_shapes([_probe(0), dataclasses.replace(_probe(1), latent_frames=22)], 0)
    with pytest.raises(ShardedDecodeError, match="no rank of the 2-rank group decoded a clip"):
        exchange.agree_on_shapes([_probe(0, count=0), _probe(1, count=0)], 0)


def test_probe_flags_its_own_ragged_clips_and_unsupported_dtypes():
    a, b = torch.zeros(1, 3, 28, 4, 4), torch.zeros(1, 3, 27, 4, 4)
    assert exchange.make_probe([a, b], False, torch.device("cpu"))[0] == ProbeStatus.RAGGED_LOCAL
    assert exchange.make_probe([a.long()], False, torch.device("cpu"))[0] == ProbeStatus.UNSUPPORTED
    assert exchange.make_probe([a], True, torch.device("cpu"))[0] == ProbeStatus.DECODER_RAISED
    probe = exchange.make_probe([a, a], False, torch.device("cpu"), latent_frames=37, units=63)
    assert probe.tolist()[:11] == [0, 2, 37, 1, 5, 63, 1, 3, 28, 4, 4]


def test_frame_sources_name_the_clips_and_cross_fades():
    plan = plan_mod.plan_clips(decode_models.tiny_vae(), 12)
    labels = judge.frame_labels(plan, 39)
    assert labels[0] == "0 (clip 0)" and labels[17] == "17 (clip 0)" and labels[18] == "18 (clip 0/1 cross-fade)"
    assert labels[22] == "22 (clip 1)" and labels[34] == "34 (clip 1)"


def test_the_split_leaves_the_busiest_rank_the_smaller_share():
    assert plan_mod.choose_split(8, 7, 9) == "tiles"  # clips: 1/7 busiest; tiles: 8/63
    assert plan_mod.choose_split(2, 4, 9) == "clips"  # a tie keeps whole clips
    assert plan_mod.choose_split(4, 7, 1) == "clips"  # no tiles to split
    assert plan_mod.busiest_share(63, 8) == 8 / 63 and plan_mod.busiest_share(7, 8) == 1 / 7
    vae = decode_models.tiny_vae()
    work = plan_mod.plan_work(vae, (1, 4, 37, 8, 8), 8)
    assert (work.split, work.num_units, work.decoder_calls, work.unit(10)) == ("tiles", 63, 63, (1, 1))
    assert plan_mod.tile_latents(torch.arange(64.0).view(1, 1, 1, 8, 8), work.tiles, 4).flatten()[0] == 18.0
    with pytest.raises(ValueError, match="split must be one of"):
        plan_mod.plan_work(vae, (1, 4, 37, 8, 8), 2, "rows")
    with pytest.raises(ValueError, match="needs tiling on"):
        plan_mod.plan_work(decode_models.tiny_vae(decode_models.VaeSpec(tiling=False)), (1, 4, 37, 8, 8), 2, "tiles")
    with pytest.raises(ValueError, match="unit 63 is outside"):
        work.unit(63)


def test_ranks_that_planned_different_splits_stop_before_the_payload():
    probes = [_probe(0), dataclasses.replace(_probe(1), units=63)]
    with pytest.raises(ShardedDecodeError, match="planned different splits .* rank 1 split the video into 63"):
        exchange.agree_on_shapes(probes, 0)
    with pytest.raises(ValueError, match="dst 4 is not a rank of the 4-rank group"):
        exchange.destination(4, 4)


def opt_in_task(frames: int) -> dict[str, object]:
    """On every rank: the opt-in entry with the flag on, and a gather-to-one that leaves ``dst`` out."""
    vae = decode_models.tiny_vae()
    z = decode_models.latents(decode_models.LatentSpec(frames))
    with torch.no_grad():
        stock = sharded.stock_decode(vae, z)
        with _spy_stock_call(vae) as seen:
            video = sharded.decode_video(vae, z, shard_across_group=True, group=dist.group.WORLD)
        gathered = sharded.sharded_decode(vae, z, dist.group.WORLD, transport="gather")
        refused = []
        for call in (lambda: sharded.sharded_decode(vae, z, None),
                     lambda: sharded.decode_video(vae, z, shard_across_group=True)):
            try:
                call()
            except ValueError as err:
                refused.append("group is None" in str(err))
    return {"video": video is not None and torch.equal(video, stock), "sharded": seen["clip_under_rebound_decode"],
            "gathered": None if gathered is None else torch.equal(gathered, stock), "none_refused": refused}


def test_the_opt_in_entry_returns_the_whole_video_on_every_rank_and_gather_lands_on_rank_0(parity_ctx):
    """decode_video shards by all-gather, so every rank returns the stock video; a gather-to-one without ``dst``
    lands on group rank 0 (the documented ``dst=0``) and the other ranks return None."""
    results = parity_ctx.world(2).run(opt_in_task, 12)
    assert [r["video"] for r in results] == [True, True]
    assert all(r["sharded"] > 0 for r in results)  # clips decoded under the rebound `_decode`: the sharded path
    assert [r["gathered"] for r in results] == [True, None]
    # a group of None is never read as "the world": both entries refuse it, naming the argument, on every rank
    assert [r["none_refused"] for r in results] == [[True, True], [True, True]]
