"""Without a world: the probe's wire format round trip, the plan for another token_drop, and input guards."""

from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch
import torch.distributed as dist

from fixtures import decode_models, decode_tasks
from harness.decode import exchange, serve, sharded
from harness.decode import plan as plan_mod
from harness.decode.exchange import Probe, ProbeStatus, ShardedDecodeError
from harness.decode.serve import bound as serve_bound

pytestmark = [pytest.mark.cpu,
              pytest.mark.skipif(decode_models.VAE_MISSING is not None, reason=str(decode_models.VAE_MISSING))]

CPU = torch.device("cpu")

STAND_IN_GROUP = types.SimpleNamespace(name="a group the patched torch.distributed sizes")


def test_every_decoder_dtype_survives_the_probe_round_trip():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        clip = torch.zeros(1, 3, 5, 2, 2, dtype=dtype)
        raw = exchange.make_probe([clip, clip.clone()], False, CPU, latent_frames=22, units=4)
        assert exchange.read_probe(3, raw) == Probe(3, ProbeStatus.OK, 2, dtype, (1, 3, 5, 2, 2), 22, 4)
    # the probe is 6 header slots and PROBE_DIMS shape slots, whatever the clip: a fixed-size collective
    widest = torch.zeros((1,) * exchange.PROBE_DIMS)
    raw = exchange.make_probe([widest], False, CPU)
    assert raw.tolist() == [0, 1, 0, 1, exchange.PROBE_DIMS, 0] + [1] * exchange.PROBE_DIMS
    assert exchange.read_probe(0, raw) == Probe(0, ProbeStatus.OK, 1, torch.float32, (1,) * exchange.PROBE_DIMS)
    too_wide = exchange.make_probe([widest[None]], False, CPU)
    assert too_wide.tolist() == [int(ProbeStatus.UNSUPPORTED), 1] + [0] * (4 + exchange.PROBE_DIMS)
    assert exchange.read_probe(1, exchange.make_probe([], False, CPU)) == Probe(1, ProbeStatus.OK, 0, None, ())


def test_plan_for_token_drop_one_and_zero_matches_the_stock_decode():
    """Clip counts measured on diffusers' AutoencoderKLMiniMaxH3 built with the tiny VAE's arguments: with
    token_drop=1 its `_decode` asks for 1 clip at 5..9 latent frames, 2 at 10..12, and has none below 5; with
    token_drop=0 it asks for 1 clip at 1 and 5 frames and 2 at 6, with no overlap. The plan reads only the config."""
    config = {**decode_models.tiny_vae().config, "token_drop": 1}
    vae = types.SimpleNamespace(config=types.SimpleNamespace(**config))
    counts = {frames: plan_mod.plan_clips(vae, frames).num_clips for frames in (5, 9, 10, 12)}
    assert counts == {5: 1, 9: 1, 10: 2, 12: 2} and {type(n) for n in counts.values()} == {int}
    with pytest.raises(ValueError, match="a latent video of 4 frames holds no whole clip .* at least 5 latent frames"):
        plan_mod.plan_clips(vae, 4)
    no_drop = types.SimpleNamespace(config=types.SimpleNamespace(**{**config, "token_drop": 0}))
    plans = {frames: plan_mod.plan_clips(no_drop, frames) for frames in (1, 5, 6)}
    assert {f: (p.num_clips, p.pad_tokens, p.token_overlap) for f, p in plans.items()} == {
        1: (1, 4, 0), 5: (1, 0, 0), 6: (2, 4, 0)}


def test_the_plan_of_a_real_vae_without_token_drop_takes_the_model_s_own_geometry():
    """token_drop=0 leaves no overlap: the model derives frame_overlap 0 (no cross-fade), and the plan agrees."""
    vae = decode_models.tiny_vae()
    no_drop = type(vae).from_config(vae.config, token_drop=0)
    plan = plan_mod.plan_clips(no_drop, 6)
    derived = ("tokens_chunk_size", "token_overlap", "frame_pre_padding", "frame_overlap")
    assert {name: getattr(plan, name) for name in derived} == {name: getattr(no_drop, name) for name in derived}
    assert (plan.num_clips, plan.token_overlap, plan.frame_overlap) == (2, 0, 0)


def test_the_gate_shards_only_when_asked_in_a_group_of_more_than_one(monkeypatch):
    assert (sharded.takes_sharded_path(True), sharded.takes_sharded_path(False)) == (False, False)  # no group
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # the gate's view of an initialised group
    for world, flag, shards in ((2, True, True), (2, False, False), (1, True, False), (1, False, False)):
        monkeypatch.setattr(dist, "get_world_size", lambda group=None, world=world: world)
        assert sharded.takes_sharded_path(flag) is shards, (world, flag)


def test_plan_and_decode_inputs_are_checked():
    vae = decode_models.tiny_vae()
    for bad in (True, 2.0, 0):
        with pytest.raises(ValueError, match=f"num_latent_frames must be a positive int, got {bad!r}"):
            plan_mod.plan_clips(vae, bad)
    with pytest.raises(ValueError, match="a latent video of 1 frames holds no whole clip"):
        plan_mod.plan_clips(vae, 1)
    no_clip_length = types.SimpleNamespace(config=types.SimpleNamespace(token_drop=3))
    with pytest.raises(TypeError, match="plan_clips needs an AutoencoderKLMiniMaxH3 .* got SimpleNamespace"):
        plan_mod.plan_clips(no_clip_length, 5)
    z = decode_models.latents(decode_models.LatentSpec(12, height=2, width=2))
    partial = types.SimpleNamespace(decode=vae.decode, config=vae.config)  # no _decode_clip to serve clips with
    with pytest.raises(TypeError, match=r"expected an AutoencoderKLMiniMaxH3 \(decode, _decode_clip"):
        sharded.stock_decode(partial, z)


def test_a_reused_payload_slab_is_zero_after_this_rank_s_pieces():
    shape = (1, 2)
    first, _ = exchange.prepare_gather([torch.full(shape, 7.0), torch.full(shape, 8.0)], 3, shape, torch.float32,
                                       CPU, 2, False)
    again, received = exchange.prepare_gather([torch.full(shape, 5.0)], 3, shape, torch.float32, CPU, 2, False)
    assert again is first and received is None  # the same key reuses the slab
    assert again.tolist() == [[[5.0, 5.0]], [[0.0, 0.0]], [[0.0, 0.0]]]


def test_gather_buffers_of_another_geometry_replace_the_held_ones():
    """One geometry at a time: a decode of another shape frees the last one's slabs instead of adding its own."""
    first, received = exchange.prepare_gather([torch.ones(1, 2)], 2, (1, 2), torch.float32, CPU, 2, True)
    held = [weakref.ref(first), *(weakref.ref(slab) for slab in received)]
    del first, received
    exchange.prepare_gather([torch.ones(3, 2)], 2, (3, 2), torch.float32, CPU, 2, True)
    gc.collect()
    assert [ref() is None for ref in held] == [True] * 3


def test_untiled_plans_count_one_decoder_call_per_clip():
    assert plan_mod.plan_tiles(types.SimpleNamespace(), 4, 4) is None  # no tiling switch: not tiled
    vae = decode_models.tiny_vae()
    with serve_bound(vae, "use_tiling", False):
        work = plan_mod.plan_work(vae, (1, 4, 37, 8, 8), 2)
    assert (work.split, work.num_units, work.decoder_calls, work.tiles) == ("clips", 7, 7, None)


def test_sharded_entries_check_the_vae_and_the_destination_before_any_collective(monkeypatch):
    vae = decode_models.tiny_vae()
    video = torch.zeros(1, vae.config.in_channels, 5, 4, 4)
    partial = types.SimpleNamespace(encode=vae.encode, decode=vae.decode, config=vae.config)
    with pytest.raises(TypeError, match="expected an AutoencoderKLMiniMaxH3"):
        sharded.sharded_encode(partial, video, None)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # a 4-rank group, as the entries see it
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    z = decode_models.latents(decode_models.LatentSpec(12, height=2, width=2))
    assert [sharded._check_transport("gather", dst, None) for dst in (0, 3)] == [None, None]  # every rank may be dst
    for dst in (4, -1, True):
        for entry, x in ((sharded.sharded_decode, z), (sharded.sharded_encode, video)):
            with pytest.raises(ValueError, match=f"dst must be a rank of the 4-rank group, got {dst!r}"):
                entry(vae, x, STAND_IN_GROUP, transport="gather", dst=dst)


def test_the_encode_clip_server_checks_windows_and_that_every_gathered_moment_was_used():
    vae = decode_models.tiny_vae()
    length = vae.config.clip_length
    padded = torch.arange(2.0 * length).reshape(1, 1, 2 * length, 1, 1)
    moments = [torch.zeros(1), torch.ones(1)]
    with serve.serve_encode_clips(vae, padded, length, moments):
        assert [vae._encode_clip(padded[:, :, :length]), vae._encode_clip(padded[:, :, length:])] == moments
    unused = pytest.raises(ShardedDecodeError, match="used 1 of the 2 gathered pieces at _encode_clip")
    with unused, serve.serve_encode_clips(vae, padded, length, moments):
        vae._encode_clip(padded[:, :, :length])
    frame = padded[:, :, :1]  # a one-frame video: `_encode_clip` sees it whole
    with serve.serve_encode_clips(vae, frame, length, moments[:1]):
        assert vae._encode_clip(frame) is moments[0]
    assert "_encode_clip" not in vae.__dict__


@pytest.mark.cpu
def test_tile_windows_are_row_major_and_refuse_a_tile_past_the_grid():
    tiles = plan_mod.TilePlan(ratio=8, y_starts=(0, 48), y_lengths=(64, 32), x_starts=(0, 48, 96),
                              x_lengths=(64, 64, 16))
    assert tiles.num_tiles == 6
    assert tiles.latent_window(0) == (slice(0, 8), slice(0, 8))
    assert tiles.latent_window(5) == (slice(6, 10), slice(12, 14))  # row 1, column 2
    for outside in (-1, 6):
        with pytest.raises(ValueError, match=rf"tile {outside} is outside this plan's 6 tiles"):
            tiles.latent_window(outside)


def test_tile_overlaps_are_each_seams_own_as_the_library_spreads_the_slack():
    tiles = plan_mod.TilePlan(ratio=8, y_starts=(0, 48), y_lengths=(64, 32), x_starts=(0, 48, 96),
                              x_lengths=(64, 64, 16))
    assert (tiles.y_overlaps, tiles.x_overlaps) == ((16,), (16, 16))
    vae = decode_models.tiny_vae()  # 8 px tiles, 2 px minimum overlap, spatial ratio 2
    assert plan_mod.plan_tiles(vae, 4, 8).x_overlaps == (4, 4)  # 16 px: 4 px of slack over two seams
    unequal = plan_mod.plan_tiles(vae, 4, 9)  # 18 px: the 2 px of slack go to the first seam only
    assert (unequal.y_overlaps, unequal.x_overlaps) == ((), (4, 2))
    assert list(unequal.x_overlaps) == type(vae)._split_tiles(vae, 18, vae.tile_sample_min_width,
                                                               vae.tile_sample_min_overlap_width)[2]


@pytest.mark.cpu
def test_the_split_shards_tiles_only_where_the_busiest_rank_gets_less():
    assert plan_mod.choose_split(4, 1, 2) == "tiles"  # one clip of two tiles: 0.5 of the work vs all of it
    assert plan_mod.choose_split(2, 4, 9) == "clips"  # 2/4 vs 18/36: a tie keeps whole clips
    assert plan_mod.choose_split(8, 7, 9) == "tiles"
    assert plan_mod.choose_split(8, 7, 1) == "clips"  # one tile per clip: nothing to split


def test_the_payload_collective_is_the_one_the_transport_names(monkeypatch):
    """all_gather: every rank's slab into every rank's receive slabs; gather: the slabs to group rank ``dst`` only,
    addressed by its global rank in a subgroup. (Without a world: a wrong collective here would leave the ranks in
    mismatched collectives, a hang until the task's timeout, not a failure.)"""
    seen = []
    monkeypatch.setattr(dist, "all_gather", lambda slabs, t, group=None: seen.append(("all_gather", slabs, t, group)))
    monkeypatch.setattr(dist, "gather", lambda t, slabs=None, dst=0, group=None: seen.append(("gather", slabs, t,
                                                                                               dst, group)))
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: {0: 4, 1: 6}[rank])  # a subgroup {4, 6}
    payload, slabs, subgroup = torch.zeros(1), [torch.zeros(1), torch.zeros(1)], object()
    assert exchange.collect(payload, slabs, "all_gather", 1, subgroup) is slabs
    assert seen == [("all_gather", slabs, payload, subgroup)]
    seen.clear()
    assert exchange.collect(payload, None, "gather", 1, subgroup) is None  # a rank that receives nothing
    assert exchange.collect(payload, slabs, "gather", 1, None) is slabs
    assert seen == [("gather", None, payload, 6, subgroup), ("gather", slabs, payload, 1, None)]


def test_the_probe_describes_clips_of_up_to_eight_dims_and_refuses_a_ninth():
    """The fixed-size probe has room for 8 dims (video clips have 5): an 8-dim clip travels with its shape, a 9-dim
    one is refused as unsupported before any payload could be sized from a truncated shape."""
    eight = torch.zeros(1, 1, 1, 1, 1, 1, 1, 2)
    assert exchange.read_probe(0, exchange.make_probe([eight], False, CPU)).shape == (1, 1, 1, 1, 1, 1, 1, 2)
    refused = exchange.read_probe(0, exchange.make_probe([eight[None]], False, CPU))
    assert (refused.status, refused.shape) == (ProbeStatus.UNSUPPORTED, ())


def test_the_clip_and_tile_servers_refuse_a_post_loop_that_leaves_a_gathered_piece_unused():
    """A library whose `_decode` asks for fewer clips (or tiles) than the plan gathered no longer matches it: the
    server raises on leaving, naming how many were used, rather than returning a video built from part of them."""
    vae = decode_models.tiny_vae()
    z = decode_models.latents(decode_models.LatentSpec(12))
    work = plan_mod.plan_work(vae, tuple(z.shape), 3)  # 2 clips of 9 tiles, split into tiles
    padded = plan_mod.pad_latents(z, work.clips)
    windows = [plan_mod.window_latents(padded, work.clips, clip) for clip in range(work.clips.num_clips)]
    clips = [torch.zeros(1), torch.ones(1)]
    with serve.serve_clips(vae, padded, work.clips, clips):
        assert [vae._decode_clip(w) for w in windows] == clips
    with pytest.raises(ShardedDecodeError, match="used 1 of the 2 gathered pieces at _decode_clip"), \
            serve.serve_clips(vae, padded, work.clips, clips):
        vae._decode_clip(windows[0])
    assert work.split == "tiles" and work.tiles is not None
    tiles = [torch.full((1,), float(unit)) for unit in range(work.num_units)]
    first = plan_mod.tile_latents(windows[0], work.tiles, 0)
    with pytest.raises(ShardedDecodeError, match="used 1 of the 18 gathered pieces at decoder"), \
            serve.serve_tiles(vae, padded, work, tiles):
        assert vae.decoder(vae.post_quant_conv(first)) is tiles[0]
    assert {"_decode_clip", "decoder", "post_quant_conv"}.isdisjoint(vae.__dict__)


def _local_group(monkeypatch: pytest.MonkeyPatch, rank: int, world: int) -> None:
    """The entries' view of rank ``rank`` of a ``world``-rank group whose exchange this process plays alone: it
    computes every piece itself, and a rank that receives assembles them as if they had been gathered."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)

    def across(compute, num_units, length, assemble, device, group, transport, dst):
        receiving = exchange.receives(rank, transport, exchange.destination(dst, world))
        return assemble([compute(unit) for unit in range(num_units)]) if receiving else None

    monkeypatch.setattr(sharded, "_across_group", across)


def test_an_encode_gathered_without_dst_lands_on_rank_0(monkeypatch):
    """``sharded_encode(..., transport="gather")`` without ``dst`` gathers to group rank 0, like sharded_decode: rank
    0 returns the stock posterior, rank 1 None."""
    vae = decode_models.tiny_vae()
    x = decode_tasks.EncodeJob(frames=18).build_video(CPU)
    with torch.no_grad():
        stock = sharded.stock_encode(vae, x).parameters
        answers = []
        for rank in (0, 1):
            _local_group(monkeypatch, rank, 2)
            answers.append(sharded.sharded_encode(vae, x, STAND_IN_GROUP, transport="gather"))
    assert serve.same_bits(answers[0].parameters, stock) and answers[1] is None


@pytest.mark.parametrize("frames", [1, 2])
def test_a_one_and_a_two_frame_video_encode_as_the_stock_call_does(frames, monkeypatch):
    """One frame is encoded whole by the spatial encoder alone, two are padded to one clip: the sharded encode's
    pieces must be the windows the library's `_encode` asks for, or its served post-loop refuses them."""
    vae = decode_models.tiny_vae()
    x = decode_tasks.EncodeJob(frames=frames).build_video(CPU)
    _local_group(monkeypatch, 0, 2)
    with torch.no_grad():
        assert serve.same_bits(sharded.sharded_encode(vae, x, STAND_IN_GROUP).parameters,
                               sharded.stock_encode(vae, x).parameters)
