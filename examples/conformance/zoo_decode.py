"""Sharded video decodes written the way a team's own framework would, for ``--impl decode=zoo_decode:NAME``.

Signature: ``sharded_decode(vae, z, group, *, transport="all_gather", dst=0)``, called on every rank of
``group`` with the same latents; with ``transport="gather"`` only group rank ``dst`` returns the video
and the others return None. ``sharded_decode`` is right and shares no code with the suite's own: each rank
takes a contiguous block of clips (not round robin, no tile split), the ranks agree through pickled
status objects (``all_gather_object``) before any clip moves, the clips travel as objects, and the
library's own ``_decode`` assembles them with its ``_decode_clip`` served from the gathered clips.

Every other callable is that implementation with one realistic bug (see ``BUGS``); each must fail the
decode checks it names. ``always_raises`` raises on every call: every decode check a conformance run judges
must fail on it (``FAILS_EVERYWHERE``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["BUGS", "CORRECT", "FAILS_EVERYWHERE", "always_raises", "drops_clips_past_the_ranks",
           "every_rank_decodes_all", "ignores_group", "ignores_transport", "loses_root_cause", "not_fail_closed",
           "returns_video_on_cpu", "sharded_decode", "stitch_crops_by_previous_overlap", "swallows_errors",
           "unblended_post_loop"]


@dataclass(frozen=True)
class Flaws:
    """Which bug the implementation carries (all False: the right one).

    The fields no ``BUGS`` entry sets re-create publicly reported bugs (``corpus/decode.py``)."""

    global_group: bool = False  # rank and collectives of the default group, not the one handed in
    no_status: bool = False  # a rank whose decoder raises leaves at once: the others wait in the gather
    swallow: bool = False  # any failure falls back to a local stock decode
    generic_error: bool = False  # the error every rank raises names the failed rank, not the cause
    decode_all: bool = False  # every rank decodes every clip (no sharding), then gathers anyway
    always_all_gather: bool = False  # transport="gather" ignored: every rank returns the video
    concat_clips: bool = False  # its own post-loop: clips concatenated, no cross-fade
    one_clip_per_rank: bool = False  # assumes clips <= ranks: rank r decodes clip r only
    group_rank_dst: bool = False  # transport="gather": the group rank handed to gather_object as its global dst
    empty_share_raises: bool = False  # clips dealt round robin; a rank dealt none raises before any collective
    output_rank_only: bool = False  # only group rank 0 assembles; under all_gather the others get an empty tensor
    own_stitch: bool = False  # its own tile stitcher, each tile cropped by the overlap of the seam behind it
    video_to_cpu: bool = False  # the video handed back through .cpu(), off the device the stock decode returns on


class ShardFailed(RuntimeError):
    """Every rank of the group stops: some rank could not do its part."""


@contextlib.contextmanager
def _instance(vae: Any, name: str, value: Callable[..., Any]) -> Iterator[None]:
    """Bind ``value`` as ``vae.<name>`` for the duration (an instance attribute shadows the method)."""
    had = name in vae.__dict__
    previous = vae.__dict__.get(name)
    vae.__dict__[name] = value
    try:
        yield
    finally:
        if had:
            vae.__dict__[name] = previous
        else:
            del vae.__dict__[name]


def _windows(vae: Any, z: torch.Tensor) -> list[torch.Tensor]:
    """The latent windows ``vae._decode`` hands its clip decoder, in order (the tail padded as it pads it)."""
    chunk, overlap, drop = vae.tokens_chunk_size, vae.token_overlap, vae.config.token_drop
    tokens = z.shape[2] + drop
    pad = (-tokens) % chunk
    clips = (tokens + pad) // chunk - (1 if drop > 0 else 0)
    if pad:
        z = torch.cat([z, z[:, :, -1:].expand(-1, -1, pad, -1, -1)], dim=2)
    return [z[:, :, i * chunk:i * chunk + chunk + overlap] for i in range(clips)]


def _stitch_by_previous_seam(vae: Any) -> Callable[..., torch.Tensor]:
    """The team's own tile stitcher (the library's blends, its own crops): each tile but the last of a row or
    column is cropped by the overlap of the seam it was blended across, not by the one ahead of it. Equal overlaps
    cannot tell the two apart; [4, 2] px crops 4 where 2 belongs."""
    def stitch(tiles: list[list[torch.Tensor]], height_overlaps: list[int],
               width_overlaps: list[int]) -> torch.Tensor:
        crop_rows = [height_overlaps[max(i - 1, 0)] for i in range(len(tiles) - 1)] + [0]
        crop_cols = [width_overlaps[max(j - 1, 0)] for j in range(len(tiles[0]) - 1)] + [0]
        stitched = []
        for i, row in enumerate(tiles):
            kept = []
            for j, tile in enumerate(row):
                if i:
                    tile = vae._blend(tiles[i - 1][j], tile, height_overlaps[i - 1], dim=-2)
                if j:
                    tile = vae._blend(row[j - 1], tile, width_overlaps[j - 1], dim=-1)
                kept.append(tile[..., :tile.shape[-2] - crop_rows[i], :tile.shape[-1] - crop_cols[j]])
            stitched.append(torch.cat(kept, dim=-1))
        return torch.cat(stitched, dim=-2)

    return stitch


def _decode_clips(vae: Any, windows: list[torch.Tensor], mine: range, flaws: Flaws) -> list[torch.Tensor]:
    """This rank's clips, each through the library's `_decode_clip` (with ``own_stitch``, its tiles stitched by
    the team's own stitcher)."""
    if not flaws.own_stitch:
        return [vae._decode_clip(windows[i]) for i in mine]
    with _instance(vae, "_stitch_tiles", _stitch_by_previous_seam(vae)):
        return [vae._decode_clip(windows[i]) for i in mine]


def _mine(count: int, rank: int, world: int, flaws: Flaws) -> range:
    """The contiguous block of clips this rank decodes."""
    if flaws.decode_all:
        return range(count)
    if flaws.one_clip_per_rank:
        return range(rank, rank + 1) if rank < count else range(0)
    if flaws.empty_share_raises:
        dealt = range(rank, count, world)
        if not dealt:
            raise ValueError(f"rank {rank}: no clips dealt to this rank ({count} clips over {world} ranks)")
        return dealt
    per = -(-count // world)
    return range(min(rank * per, count), min((rank + 1) * per, count))


def _agree(statuses: list[dict[str, Any]], rank: int, failure: BaseException | None, flaws: Flaws) -> None:
    """Raise on every rank, together, when any rank failed or the ranks disagree on the video or the clips."""
    failed = [s["rank"] for s in statuses if s["error"]]
    if failed:
        detail = "; ".join(f"rank {s['rank']}: {s['error']}" for s in statuses if s["error"])
        if flaws.generic_error:
            raise ShardFailed(f"rank {rank}: sharded decode failed on ranks {failed}")
        raise ShardFailed(f"rank {rank}: ranks {failed} could not decode their clips ({detail})") from failure
    if len({s["latents"] for s in statuses}) > 1:
        raise ShardFailed(f"rank {rank}: the ranks hold different latents: "
                          + "; ".join(f"rank {s['rank']} {s['latents']}" for s in statuses))
    if len({shape for s in statuses for shape in s["shapes"]}) > 1:
        raise ShardFailed(f"rank {rank}: decoded clips of different shapes: "
                          + "; ".join(f"rank {s['rank']} {s['shapes']}" for s in statuses))


def _decode_call(vae: Any, z: torch.Tensor, group: Any, transport: str, dst: int, flaws: Flaws) -> torch.Tensor:
    """One `_decode(z)` call spread over the group (bound over the instance's `_decode`)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    windows = _windows(vae, z)
    mine = _mine(len(windows), rank, world, flaws)
    clips, failure = [], None
    try:
        clips = _decode_clips(vae, windows, mine, flaws)
    except Exception as err:
        if flaws.no_status:
            raise
        failure = err
    status = {"rank": rank, "error": f"{type(failure).__name__}: {failure}" if failure else "",
              "latents": tuple(z.shape), "shapes": sorted({tuple(c.shape) for c in clips})}
    statuses: list[Any] = [None] * world
    dist.all_gather_object(statuses, status, group=group)
    _agree(statuses, rank, failure, flaws)
    mine_by_rank: list[Any] = [None] * world
    receiving = flaws.always_all_gather or transport == "all_gather" or rank == dst
    if flaws.output_rank_only:
        receiving = rank == (0 if transport == "all_gather" else dst)
    payload = {"rank": rank, "clips": list(mine), "decoded": [c.cpu() for c in clips]}
    if flaws.always_all_gather or transport == "all_gather":
        dist.all_gather_object(mine_by_rank, payload, group=group)
    else:
        target = dst if group is None or flaws.group_rank_dst else dist.get_global_rank(group, dst)
        dist.gather_object(payload, mine_by_rank if rank == dst else None, dst=target, group=group)
    video, failure = None, None
    if receiving:
        try:
            served = {i: c.to(z.device) for part in mine_by_rank for i, c in zip(part["clips"], part["decoded"],
                                                                                  strict=True)}
            video = _assemble(vae, z, windows, [served[i] for i in range(len(windows))], flaws)
        except Exception as err:  # noqa: BLE001 - told to every rank through the status exchange
            failure = err
    done: list[Any] = [None] * world
    dist.all_gather_object(done, "" if failure is None else f"{type(failure).__name__}: {failure}", group=group)
    if any(done):
        raise ShardFailed(f"rank {rank}: assembling the video failed on ranks "
                          f"{[r for r, d in enumerate(done) if d]}: {[d for d in done if d]}") from failure
    return video if video is not None else z.new_empty(0)


def _assemble(vae: Any, z: torch.Tensor, windows: list[torch.Tensor], clips: list[torch.Tensor],
              flaws: Flaws) -> torch.Tensor:
    """The library's own `_decode` post-loop over the gathered clips (each call's window verified)."""
    if flaws.concat_clips:
        return torch.cat([c[:, :, vae.frame_pre_padding:] for c in clips], dim=2)[:, :, :_frames(vae, z)]
    calls = iter(range(len(clips)))

    def served(window: torch.Tensor) -> torch.Tensor:
        i = next(calls)
        if not torch.equal(window, windows[i]):
            raise ShardFailed(f"the library asked for clip {i} with another window than planned")
        return clips[i]

    with _instance(vae, "_decode_clip", served):
        return type(vae)._decode(vae, z)


def _frames(vae: Any, z: torch.Tensor) -> int:
    """Pixel frames of the whole video (17n+5 for 5n+2 latent frames)."""
    return (z.shape[2] - 1) * vae.temporal_compression_ratio + 1


def _sharded(vae: Any, z: torch.Tensor, group: Any, transport: str, dst: int, flaws: Flaws) -> torch.Tensor | None:
    if transport not in ("all_gather", "gather"):
        raise ValueError(f"transport must be 'all_gather' or 'gather', got {transport!r}")
    if flaws.global_group:
        group = None
    rank = dist.get_rank(group)

    def per_call(latents: torch.Tensor) -> torch.Tensor:
        return _decode_call(vae, latents, group, transport, dst, flaws)

    try:
        with _instance(vae, "_decode", per_call):
            video = vae.decode(z).sample
    except Exception:
        if flaws.swallow:
            return vae.decode(z).sample
        raise
    receives = flaws.always_all_gather or transport == "all_gather" or rank == dst
    if not receives:
        return None
    return video.cpu() if flaws.video_to_cpu else video


def _implementation(flaws: Flaws, doc: str) -> Callable[..., torch.Tensor | None]:
    def sharded_decode(vae: Any, z: torch.Tensor, group: Any = None, *, transport: str = "all_gather",
                       dst: int = 0) -> torch.Tensor | None:
        return _sharded(vae, z, group, transport, dst, flaws)

    sharded_decode.__doc__ = doc
    return sharded_decode


CORRECT = Flaws()
sharded_decode = _implementation(CORRECT, "Right: contiguous clip blocks, fail-closed statuses, the library's "
                                          "post-loop.")
BUGS = {
    "ignores_group": (replace(CORRECT, global_group=True),
                      "uses the default group's ranks and collectives, not the group it is handed"),
    "not_fail_closed": (replace(CORRECT, no_status=True),
                        "a rank whose decoder raises leaves at once; the others wait in the next collective"),
    "swallows_errors": (replace(CORRECT, swallow=True), "any failure falls back to a local stock decode"),
    "loses_root_cause": (replace(CORRECT, generic_error=True),
                         "the raised error names the failed ranks but drops the cause"),
    "every_rank_decodes_all": (replace(CORRECT, decode_all=True), "every rank decodes every clip, then gathers"),
    "ignores_transport": (replace(CORRECT, always_all_gather=True),
                          "transport='gather' ignored: every rank returns the video"),
    "unblended_post_loop": (replace(CORRECT, concat_clips=True),
                            "its own post-loop concatenates the clips without the cross-fade"),
    "drops_clips_past_the_ranks": (replace(CORRECT, one_clip_per_rank=True),
                                   "assumes clips <= ranks: rank r decodes clip r only"),
    "stitch_crops_by_previous_overlap": (replace(CORRECT, own_stitch=True),
                                         "its own tile stitcher crops each seam by the previous seam's overlap"),
    "returns_video_on_cpu": (replace(CORRECT, video_to_cpu=True),
                             "the decoded video handed back through .cpu(), off the device it was decoded on"),
}
ignores_group = _implementation(*BUGS["ignores_group"])
not_fail_closed = _implementation(*BUGS["not_fail_closed"])
swallows_errors = _implementation(*BUGS["swallows_errors"])
loses_root_cause = _implementation(*BUGS["loses_root_cause"])
every_rank_decodes_all = _implementation(*BUGS["every_rank_decodes_all"])
ignores_transport = _implementation(*BUGS["ignores_transport"])
unblended_post_loop = _implementation(*BUGS["unblended_post_loop"])
drops_clips_past_the_ranks = _implementation(*BUGS["drops_clips_past_the_ranks"])
stitch_crops_by_previous_overlap = _implementation(*BUGS["stitch_crops_by_previous_overlap"])
returns_video_on_cpu = _implementation(*BUGS["returns_video_on_cpu"])


def always_raises(vae: Any, z: torch.Tensor, group: Any = None, *, transport: str = "all_gather",
                  dst: int = 0) -> torch.Tensor | None:
    """Never decodes: every check that calls it must fail."""
    raise RuntimeError("always_raises: this sharded_decode never decodes")


FAILS_EVERYWHERE = {"always_raises": "raises on every call: every judged check must fail"}
