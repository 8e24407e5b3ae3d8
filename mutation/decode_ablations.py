"""Ablations of the decode path: known bugs re-introduced over its seams.

The decode PR's failure modes (docs/contracts.md), the fail-closed steps after the probe, the tile,
transport, encode and buffer-cache bugs, the spies' teeth (a sharded path that decodes
everything everywhere, a gate that ignores the flag) and the oracle's (a plan that mislabels the
cross-fade frames, which no parity comparison reads). Splits of the tiny geometry (3 x 3 tiles per
clip): t37 shards tiles at W = 2, 3, 4, 6, 8; t22 clips at W = 2, 4 and tiles at 3, 5, 8; t12 clips at
W = 2, tiles at 4, 8; t30.w4, t13.w7 and t9.w8 tiles; t13.w3 clips.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fixtures import decode_space
from fixtures.decode_models import installed_vaes
from harness.decode import plan as plan_mod
from harness.decode.exchange import Probe, ProbeStatus, ShardedDecodeError
from harness.decode.serve import bound
from harness.judging.ablation import ablation
from harness.judging.checkid import CheckId
from harness.process.dist import WorldTaskError

ENCODES = ["decode.encode.f40.w2.bitexact", "decode.encode.f51.w4.bitexact",
           "decode.encode.f40.w3.gather_dst1.bitexact", "decode.encode.f40.w2.fp16_autocast.bitexact"]
FAIL_CLOSED = "every rank raises within"

# How long an ablated world whose ranks block in a collective runs before it is closed. The verdict is the same at any
# bound (blocked ranks are a broken fail-closed contract either way), so the bound only has to sit well above the time
# a healthy eight-rank fault world takes to answer (under 1 s on 2 cores in every dispatch lane) and below
# harness.process.dist.ERROR_GRACE_S, so one raising rank does not wait out the whole grace. Each blocked kill
# costs this long.
BLOCKED_WORLD_S = 2.0


def _installed(worlds: Sequence[int]) -> list[str]:
    """The seed matrix's bitexact checks on every installed VAE (harness.plugins.entry_points.VAES) at ``worlds``."""
    cases = [f"t{frames}.w{world}" for frames in (37, 22, 12) for world in worlds]
    return [str(check) for check in CheckId.grid("decode", installed_vaes(), cases, ("bitexact",))]


# ------------------------------------------------------------------ gathered pieces left in rank-major order


def _rank_major(slabs: Sequence[torch.Tensor], num_units: int, world_size: int) -> list[torch.Tensor]:
    """Rank 0's pieces, then rank 1's, ...: right only while every rank owns at most one piece."""
    return [slabs[rank][slot] for rank in range(world_size)
            for slot in range(len(plan_mod.owned_units(num_units, rank, world_size)))]


ablation(
    name="decode.rank_major_order",
    seam="harness.decode.exchange:order_units",
    replacement=_rank_major,
    kills=["decode.t37.w2.bitexact", "decode.t22.w2.bitexact", "decode.t30.w4.bitexact",
           "decode.t37.w3.decoded_once", "decode.t22.w3.batch2.bitexact"],
    why="round-robin ownership interleaves pieces across ranks; concatenating the gathered slabs rank by rank "
        "puts piece r+W right after piece r wherever a rank owns two or more",
    kill_mode="tolerance",
)

# ------------------------------------------------------------------ a short rank's zero padding taken as a piece


def _every_slot(slabs: Sequence[torch.Tensor], num_units: int, world_size: int) -> list[torch.Tensor]:
    """Every gathered slot in round-robin order, the zero padding of short and idle ranks included."""
    return [slab[slot] for slot in range(slabs[0].shape[0]) for slab in slabs]


ablation(
    name="decode.idle_zero_slab_taken",
    seam="harness.decode.exchange:order_units",
    replacement=_every_slot,
    kills=["decode.t37.w8.bitexact", "decode.t12.w4.bitexact", "decode.t9.w8.bitexact",
           "decode.t13.w7.bitexact"],
    why="a rank with fewer pieces than the slab holds sends zeros so the gather sizes match; taking those zeros "
        "as pieces hands the post-loop more pieces than the plan has, which the server refuses, and the assemble "
        "status exchange makes every rank raise (WorldTaskError, all ranks raised)",
    raises=(WorldTaskError,),
    kill_mode="raises",
)

# ------------------------------------------------------------------ one temporal cross-fade skipped


def _skip_first_crossfade(original: Callable[[Any, torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    def run_post_loop(vae: Any, z: torch.Tensor) -> torch.Tensor:
        blend = vae._blend
        fades = [0]

        def blend_all_but_first_fade(a: torch.Tensor, b: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
            if dim == -3:
                fades[0] += 1
                if fades[0] == 1:
                    return b
            return blend(a, b, extent, dim)

        with bound(vae, "_blend", blend_all_but_first_fade):
            return original(vae, z)

    return run_post_loop


ablation(
    name="decode.crossfade_skipped",
    seam="harness.decode.serve:run_post_loop",
    replacement=_skip_first_crossfade,
    wraps=True,
    kills=["decode.gpu.bitexact", "decode.t22.w4.bitexact", "decode.t12.w2.bitexact", "decode.t13.w3.bitexact",
           "decode.t12.w8.bitexact"],
    why="clips 0 and 1 overlap by frame_overlap pixel frames; taking clip 1's frames unblended changes exactly "
        "those frames, a post-loop that is not the library's",
    kill_mode="tolerance",
)

# ------------------------------------------------------------------ shape agreement from the local piece only


def _local_shape_only(probes: Sequence[Probe], rank: int) -> tuple[tuple[int, ...], torch.dtype]:
    """Trust this rank's own piece (an idle rank borrows the first working rank's): nobody else's failure
    or extent is seen, so a faulty rank stops alone and the others go on without it."""
    mine = probes[rank]
    if mine.status != ProbeStatus.OK:
        raise ShardedDecodeError(f"rank {rank}: {mine.status.describe()}")
    source = mine if mine.count else next(p for p in probes if p.count)
    assert source.dtype is not None
    return source.shape, source.dtype


ablation(
    name="decode.shape_agreement_local",
    seam="harness.decode.exchange:agree_on_shapes",
    replacement=_local_shape_only,
    kills=["decode.fault.w8.decoder_raises", "decode.fault.w8.ragged_clip", "decode.fault.w8.latents_ragged"],
    why="the decode PR's first iteration: agreement from the local piece only leaves 7 ranks blocked in the next "
        "collective when rank 3's decoder raises (reported blocked after the grace period), and a ragged piece "
        "makes gloo abort the mismatched gather; either way not every rank raising ShardedDecodeError together",
    hang_timeout_s=BLOCKED_WORLD_S,
    kill_mode="fact",
    fact=FAIL_CLOSED,
)

# ------------------------------------------------------------------ only rank 0's pieces used


def _rank0_slab_for_all(payload: torch.Tensor, received: list[torch.Tensor] | None, transport: str, dst: int,
                        group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Broadcast instead of gathering: every rank ends up with rank 0's slab in every rank's place."""
    dist.broadcast(payload, src=0, group=group)
    return [payload] * dist.get_world_size(group)


ablation(
    name="decode.rank0_clips_only",
    seam="harness.decode.exchange:collect",
    replacement=_rank0_slab_for_all,
    kills=["decode.gpu.bitexact", "decode.gpu.fp16_autocast", "decode.t37.w4.bitexact", "decode.t22.w8.bitexact",
           "decode.t22.w2.fp16_autocast.bitexact", "decode.t37.w8.fp16_autocast.bitexact",
           "decode.t22.w2.batch2_sliced.bitexact", "decode.encode.f40.w2.bitexact", "decode.encode.f51.w4.bitexact",
           *_installed(worlds=(2, 4, 8))],
    why="every piece owned by rank r > 0 is replaced by one of rank 0's, so all but rank 0's frames are wrong on "
        "every receiving rank while the shapes still look right",
    kill_mode="tolerance",
)

# ------------------------------------------------------------------ a wrong-valued piece of the right shape


def _last_piece_scaled(compute: Callable[[int], torch.Tensor],
                       units: Sequence[int]) -> tuple[list[torch.Tensor], BaseException | None]:
    pieces = [compute(unit) for unit in units]
    if pieces:
        pieces[-1] = pieces[-1] * (1 + 2.0 ** -6)
    return pieces, None


ablation(
    name="decode.wrong_valued_piece",
    seam="harness.decode.sharded:decode_pieces",
    replacement=_last_piece_scaled,
    kills=["decode.t22.w5.bitexact", "decode.t37.w6.bitexact", "decode.t12.w8.bf16.bitexact",
           "decode.t37.w4.bf16.bitexact", "decode.t22.w2.gather.bitexact", "decode.encode.f1.w2.bitexact",
           "decode.encode.f40.w2.fp16_autocast.bitexact"],
    why="every shape, count and hash-free spy is right and only the values of one piece per rank are off (a clip "
        "decoded from a stale or neighbouring window): the probe cannot see it, only the bitwise comparison can",
    kill_mode="tolerance",
)

# ------------------------------------------------------------------ status exchanges after the probe skipped


def _no_status_exchange(step: str, failure: BaseException | None, rank: int, device: torch.device,
                        group: dist.ProcessGroup | None = None) -> None:
    return None


ablation(
    name="decode.status_exchange_skipped",
    seam="harness.decode.exchange:confirm",
    replacement=_no_status_exchange,
    kills=["decode.fault.w8.gather_raises", "decode.fault.w8.post_loop_raises"],
    why="fail-closed only at the probe. A rank whose gather buffers fail stops alone and the other "
        "7 block in the payload all-gather; a rank whose post-loop fails returns nothing while the others return "
        "a video. Either way not every rank raising ShardedDecodeError together",
    hang_timeout_s=BLOCKED_WORLD_S,
    kill_mode="fact",
    fact=FAIL_CLOSED,
)

# ------------------------------------------------------------------ every rank decodes every piece (spy teeth)


def _all_units(num_units: int, rank: int, world_size: int) -> tuple[int, ...]:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size} ranks")
    return tuple(range(num_units))


ablation(
    name="decode.every_rank_decodes_all",
    seam="harness.decode.plan:owned_units",
    replacement=_all_units,
    kills=["decode.t37.w4.bitexact", "decode.t22.w2.bitexact", "decode.t12.w8.bitexact",
           "decode.t37.w3.decoded_once"],
    why="the decode PR's waste itself: every rank decodes the whole video; the gathered video is still bit-exact, so "
        "only the per-rank decoder-call spy (each piece exactly once across the world) can catch it",
    kill_mode="fact",
    fact="each piece decoded exactly once across the world",
)

# ------------------------------------------------------------------ the gate ignores the flag and W == 1


def _always_shard(enabled: bool, group: dist.ProcessGroup | None = None) -> bool:
    return dist.is_available() and dist.is_initialized()


ablation(
    name="decode.gate_ignores_flag",
    seam="harness.decode.sharded:takes_sharded_path",
    replacement=_always_shard,
    kills=["decode.t37.w1.bitexact", "decode.t22.w1.bitexact", "decode.t12.w1.bitexact",
           "decode.t37.w4.flag_off.stock_call",
           *_installed(worlds=(1,))],
    why="the flag defaults to off and W == 1 must take the stock call unchanged; a gate that shards whenever a "
        "group exists is bit-exact too, so only the collective and decoder-call spies can tell",
    kill_mode="fact",
    fact="the stock call was taken: every rank decoded every piece",
)

# ------------------------------------------------------------------ a tile stitched in the wrong order


def _transposed_tiles(original: Callable[..., Any]) -> Callable[..., Any]:
    def serve_tiles(vae: Any, padded: torch.Tensor, work: plan_mod.WorkPlan, tiles: Sequence[torch.Tensor]) -> Any:
        grid = work.tiles
        assert grid is not None
        rows, cols = len(grid.y_starts), len(grid.x_starts)
        per_clip = rows * cols

        def source(t: int) -> int:  # column-major where the grid is square, reversed where it is not
            return (t % cols) * cols + t // cols if rows == cols else per_clip - 1 - t

        clips = range(len(tiles) // per_clip)
        swapped = [tiles[clip * per_clip + source(t)] for clip in clips for t in range(per_clip)]
        return original(vae, padded, work, swapped)

    return serve_tiles


ablation(
    name="decode.tile_stitched_transposed",
    seam="harness.decode.serve:serve_tiles",
    replacement=_transposed_tiles,
    wraps=True,
    kills=["decode.t37.w8.bitexact", "decode.t22.w2.tiles.bitexact", "decode.t37.w4.gather_dst2.bitexact",
           "decode.t13.w7.bitexact", "decode.t12.w4.bitexact"],
    why="tiles gathered row-major but served column-major: tile (0, 1) lands where (1, 0) belongs; every tile has "
        "the same shape, so only the pixels can tell",
    kill_mode="tolerance",
)

# ------------------------------------------------------------------ a tile overlap blended twice


def _spatial_blend_twice(original: Callable[[Any, torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    def run_post_loop(vae: Any, z: torch.Tensor) -> torch.Tensor:
        blend = vae._blend

        def blend_twice(a: torch.Tensor, b: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
            once = blend(a, b, extent, dim)
            return blend(a, once, extent, dim) if dim in (-1, -2) else once

        with bound(vae, "_blend", blend_twice):
            return original(vae, z)

    return run_post_loop


ablation(
    name="decode.tile_overlap_blended_twice",
    seam="harness.decode.serve:run_post_loop",
    replacement=_spatial_blend_twice,
    wraps=True,
    kills=["decode.t37.w2.bitexact", "decode.t22.w8.bitexact", "decode.t9.w8.bitexact", "decode.t30.w4.bitexact",
           "decode.t37.w8.fp16_autocast.bitexact"],
    why="stitching served tiles whose overlaps were already cross-faded (a stitch done on the rank and again in the "
        "post-loop) fades every tile seam twice; the seams' pixels move, nothing else does",
    kill_mode="tolerance",
)

# ------------------------------------------------------------------ gather-to-one lands on the wrong rank


def _next_rank(dst: int, world_size: int) -> int:
    return (dst + 1) % world_size


ablation(
    name="decode.gather_destination_wrong",
    seam="harness.decode.exchange:destination",
    replacement=_next_rank,
    kills=["decode.t37.w4.gather_dst2.bitexact", "decode.t22.w2.gather.bitexact",
           "decode.encode.f40.w3.gather_dst1.bitexact", "decode.gpu.gather_to_one"],
    why="a group-local rank taken for the next one (or a global one): the video is assembled on a rank that did "
        "not ask for it and the destination gets None; the bytes are right, the holder is wrong",
    kill_mode="fact",
    fact="only the receiving ranks hold the output",
)

# ------------------------------------------------------------------ a group rank passed where the global rank is wanted


def _group_rank_as_global(payload: torch.Tensor, received: list[torch.Tensor] | None, transport: str, dst: int,
                          group: dist.ProcessGroup | None = None) -> list[torch.Tensor] | None:
    """``dist.gather`` handed the group's rank as ``dst``: right on the world group, wrong in any subgroup."""
    if transport == "all_gather":
        assert received is not None
        dist.all_gather(received, payload, group=group)
        return received
    dist.gather(payload, received, dst=dst, group=group)
    return received


ablation(
    name="decode.gather_dst_group_rank",
    seam="harness.decode.exchange:collect",
    replacement=_group_rank_as_global,
    kills=["decode.t22.w4.subgroups_gather_dst1.bitexact"],
    why="torch.distributed.gather takes dst as a global rank; the group's rank is the same number only on the world "
        "group, so in a subgroup the gather targets a rank outside it or the wrong member, and every rank raises",
    raises=(WorldTaskError,),
    kill_mode="raises",
)

# ------------------------------------------------------------------ encode clips concatenated without the rule


def _encode_concat_all(vae: Any, x: torch.Tensor) -> torch.Tensor:
    """Concatenate every served clip's moments, keeping the token_drop tail the library cuts."""
    clip_length = vae.config.clip_length
    frames = x.shape[2]
    if frames == 1:
        return vae._encode_clip(x)
    pad = (-frames) % clip_length
    padded = torch.cat([x, x[:, :, -1:].repeat(1, 1, pad, 1, 1)], dim=2) if pad else x
    return torch.cat([vae._encode_clip(padded[:, :, i:i + clip_length])
                      for i in range(0, padded.shape[2], clip_length)], dim=2)


ablation(
    name="decode.encode_concat_without_drop",
    seam="harness.decode.serve:run_encode_post_loop",
    replacement=_encode_concat_all,
    kills=[*ENCODES, "decode.gpu.encode_bitexact"],
    why="`_encode` concatenates the clips' moments and then drops the token_drop trailing latent frames the "
        "decoder re-derives as its overlap; a plain concatenation keeps them, one latent video too long",
    kill_mode="tolerance",
)

# ------------------------------------------------------------------ gather buffers: the cache key and the refill


def _key_without_dtype(world_size: int, slots: int, shape: tuple[int, ...], dtype: torch.dtype,
                       device: torch.device, receiving: bool) -> tuple[object, ...]:
    return (world_size, slots, tuple(shape), str(device), receiving)


ablation(
    name="decode.dtype_cache_stale",
    seam="harness.decode.exchange:buffer_key",
    replacement=_key_without_dtype,
    kills=["decode.t22.w2.dtype_switch.bitexact"],
    why="buffers cached by shape alone: after the model changes dtype the old float32 buffers take the bfloat16 "
        "pieces (a silent cast), and the post-loop returns a float32 video where the stock one is bfloat16",
    kill_mode="tolerance",
)


def _stale_payload(original: Callable[..., Any]) -> Callable[..., Any]:
    from harness.decode import exchange

    def prepare_gather(pieces: Sequence[torch.Tensor], slots: int, shape: tuple[int, ...], dtype: torch.dtype,
                       device: torch.device, world_size: int, receiving: bool) -> Any:
        key = exchange.buffer_key(world_size, slots, shape, dtype, device, receiving)
        cached = exchange._BUFFERS.get(key)
        return cached if cached is not None else original(pieces, slots, shape, dtype, device, world_size, receiving)

    return prepare_gather


ablation(
    name="decode.cached_payload_not_refilled",
    seam="harness.decode.exchange:prepare_gather",
    replacement=_stale_payload,
    wraps=True,
    kills=["decode.t37.w4.repeat3.identical"],
    why="reusing the cached buffers without copying this call's pieces in sends the previous call's pieces: the "
        "first decode of a geometry is right, and the next decode of another video of that geometry repeats it",
    kill_mode="tolerance",
)

# ------------------------------------------------------------------ the plan mislabels the cross-fade (oracle)


def _fade_from_offset_zero(plan: plan_mod.ClipPlan, num_frames: int) -> list[tuple[int, ...]]:
    sources: list[tuple[int, ...]] = []
    for frame in range(num_frames):
        clip, offset = divmod(frame, plan.chunk_frames)
        if clip >= plan.num_clips:
            sources.append((plan.num_clips - 1,))
        elif clip > 0 and offset < plan.frame_overlap:
            sources.append((clip - 1, clip))
        else:
            sources.append((clip,))
    return sources


ablation(
    name="decode.fade_labels_off_by_one",
    seam="harness.decode.plan:frame_sources",
    replacement=_fade_from_offset_zero,
    kills=["decode.oracle.call_sequence"],
    why="the fade's first frame carries weight 0 on the next clip, so it is the previous clip's alone; a plan that "
        "counts it as a cross-fade mislabels the frames every failure message points at. No parity comparison "
        "reads the labels, so only the library-call oracle sees it",
    kill_mode="fact",
    fact="every output frame's source clips match the library's cross-fade",
)

# ------------------------------------------------------------------ the group handed in ignored


def _default_group(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def decode_across_group(vae: Any, z: torch.Tensor, *, group: Any, **options: Any) -> torch.Tensor:
        return original(vae, z, group=dist.group.WORLD, **options)

    return decode_across_group


ablation(
    name="decode.group_ignored",
    seam="harness.decode.sharded:_decode_across_group",
    replacement=_default_group,
    wraps=True,
    kills=["decode.t37.w8.subgroups.bitexact"],
    why="the pieces are owned and gathered over the default group, not the group handed in: two subgroups decoding "
        "two videos at once each assemble a video from both (group rank != global rank)",
    kill_mode="tolerance",
)

# ------------------------------------------------------------------ a failed payload collective retried


def _retried(original: Callable[..., Any]) -> Callable[..., Any]:
    def collect(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except Exception:  # noqa: BLE001 - the bug: a transport error is swallowed and the collective re-run
            return original(*args, **kwargs)

    return collect


ablation(
    name="decode.payload_collective_retried",
    seam="harness.decode.exchange:collect",
    replacement=_retried,
    wraps=True,
    kills=["decode.fault.w8.group_raises"],
    why="a transport error in the payload collective is swallowed and the collective re-run: the group that failed "
        "returns a video instead of every rank raising the error it saw",
    kill_mode="fact",
    fact=FAIL_CLOSED,
)

# ------------------------------------------------------------------ a stitcher cropping by the previous seam's overlap

UNEQUAL_TILED = [decode_space.check_id(p) for p in decode_space.POINTS
                 if p["overlaps"] == "unequal" and decode_space.split(p) == "tiles"]


def _stitch_cropping_by_previous_seam(vae: Any) -> Callable[..., torch.Tensor]:
    """The tile stitch with one slip: each tile is cropped by the overlap of the seam it was just blended across,
    not by its own next seam's. Equal overlaps hide it; [4, 2] px crops 4 where 2 belongs."""
    def stitch(tiles: list[list[torch.Tensor]], height_overlaps: list[int],
               width_overlaps: list[int]) -> torch.Tensor:
        rows = []
        for i, row in enumerate(tiles):
            kept = []
            for j, tile in enumerate(row):
                if i > 0:
                    tile = vae._blend(tiles[i - 1][j], tile, height_overlaps[i - 1], dim=-2)
                if j > 0:
                    tile = vae._blend(row[j - 1], tile, width_overlaps[j - 1], dim=-1)
                if i < len(tiles) - 1:
                    tile = tile[..., :-height_overlaps[max(i - 1, 0)], :]
                if j < len(row) - 1:
                    tile = tile[..., :-width_overlaps[max(j - 1, 0)]]
                kept.append(tile)
            rows.append(torch.cat(kept, dim=-1))
        return torch.cat(rows, dim=-2)

    return stitch


def _served_to_a_stitch_cropping_by_previous_seam(original: Callable[..., Any]) -> Callable[..., Any]:
    @contextlib.contextmanager
    def serve_tiles(vae: Any, padded: torch.Tensor, work: plan_mod.WorkPlan,
                    tiles: Sequence[torch.Tensor]) -> Iterator[Any]:
        with original(vae, padded, work, tiles) as server, \
                bound(vae, "_stitch_tiles", _stitch_cropping_by_previous_seam(vae)):
            yield server

    return serve_tiles


ablation(
    name="decode.stitch_crops_previous_overlap",
    seam="harness.decode.serve:serve_tiles",
    replacement=_served_to_a_stitch_cropping_by_previous_seam,
    wraps=True,
    kills=UNEQUAL_TILED,
    why="the served tiles stitched with each tile cropped by the seam behind it: a grid whose overlaps are equal "
        "stitches right, an unequal one ([4, 2] px over a 9-wide latent frame) loses 2 px per clip; only the space "
        "points with unequal overlaps whose tiles are served see it",
    kill_mode="tolerance",
)

# ------------------------------------------------------------------ the video handed back on the CPU

# every space point (each one shards) and a check of each input form the space leaves out (gather to one rank,
# fp16 autocast), the rest of the sharded checks unclaimed to spare the gate; the gpu tier's, where the device
# itself shows it too
ON_THE_CPU = [*map(decode_space.check_id, decode_space.POINTS), "decode.t22.w2.gather.bitexact",
              "decode.t22.w4.subgroups_gather_dst1.bitexact", "decode.t22.w2.fp16_autocast.bitexact",
              "decode.gpu.bitexact"]


def _returned_on_the_cpu(original: Callable[..., torch.Tensor | None]) -> Callable[..., torch.Tensor | None]:
    def sharded_decode(vae: Any, z: torch.Tensor, group: Any, **options: Any) -> torch.Tensor | None:
        video = original(vae, z, group, **options)
        return None if video is None else video.cpu()

    return sharded_decode


ablation(
    name="decode.video_returned_on_cpu",
    seam="harness.decode.sharded:sharded_decode",
    replacement=_returned_on_the_cpu,
    wraps=True,
    kills=ON_THE_CPU,
    why="the sharded decode hands back video.cpu(): the same bytes, off the device the stock decode returns on. A "
        "GPU run sees the device; on the CPU tier every device is the CPU, so only the transfer fact (the returned "
        "video is what a .cpu() made) can tell",
    kill_mode="fact",
    fact="was moved to the CPU by the call",
)
