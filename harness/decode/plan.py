"""The temporal clip plan of the stock MiniMax-H3 `_decode`, derived once from the VAE config.

`_decode` pads the latent video by repeating its last frame, then decodes overlapping latent windows
(clip i reads latent frames [i * tokens_chunk_size, i * tokens_chunk_size + window_length)) and
cross-fades consecutive clips. The sharded decode needs that geometry before the stock loop runs, so
it is computed here with names instead of numbers, and cross-checked against the attributes the
installed model derived itself: a re-vendored model with other geometry stops here, not in a
collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SPLITS", "ClipPlan", "TilePlan", "WorkPlan", "busiest_share", "choose_split", "frame_sources",
           "owned_clips", "owned_units", "pad_latents", "plan_clips", "plan_tiles", "plan_work", "tile_latents",
           "window_latents"]

SPLITS = ("auto", "clips", "tiles")


@dataclass(frozen=True)
class ClipPlan:
    """Where each clip of one `_decode(z)` call reads its latents (all in latent frames unless named)."""

    num_latent_frames: int  # frames of z as `_decode` receives it
    clip_length: int  # pixel frames per encoder chunk (config)
    temporal_ratio: int  # pixel frames per latent frame
    tokens_chunk_size: int  # latent frames each clip advances by
    token_drop: int  # latent frames the encoder dropped per chunk (config)
    token_overlap: int  # latent frames a clip window reaches into the next chunk
    frame_pre_padding: int  # pixel frames cut from the front of every decoded chunk
    frame_overlap: int  # pixel frames cross-faded between consecutive clips
    pad_tokens: int  # copies of the last latent frame appended before decoding
    num_clips: int

    @property
    def window_length(self) -> int:
        return self.tokens_chunk_size + self.token_overlap

    @property
    def padded_latent_frames(self) -> int:
        return self.num_latent_frames + self.pad_tokens

    @property
    def chunk_frames(self) -> int:
        """Pixel frames one clip contributes before the cross-fade (its first chunk, pre-padding cut)."""
        return self.tokens_chunk_size * self.temporal_ratio - self.frame_pre_padding

    def window(self, clip: int) -> tuple[int, int]:
        """Latent frames [start, stop) of the padded video that clip ``clip`` decodes."""
        if not 0 <= clip < self.num_clips:
            raise ValueError(f"clip {clip} is outside this plan's {self.num_clips} clips")
        start = clip * self.tokens_chunk_size
        return start, start + self.window_length


def _geometry(config: Any) -> dict[str, int]:
    clip_length = int(config.clip_length)
    token_drop = int(config.token_drop)
    temporal_ratio = math.prod(int(f) for f in config.temporal_downsample_factors)
    tokens_chunk_size = math.ceil(clip_length / temporal_ratio)
    token_overlap = (-token_drop) % tokens_chunk_size
    frame_pre_padding = (-clip_length) % temporal_ratio
    return {
        "clip_length": clip_length,
        "temporal_ratio": temporal_ratio,
        "tokens_chunk_size": tokens_chunk_size,
        "token_drop": token_drop,
        "token_overlap": token_overlap,
        "frame_pre_padding": frame_pre_padding,
        "frame_overlap": max(token_overlap * temporal_ratio - frame_pre_padding, 0),
    }


def _clip_count(num_latent_frames: int, geometry: dict[str, int]) -> tuple[int, int]:
    """(pad_tokens, num_clips) for a latent video of ``num_latent_frames`` frames."""
    chunk = geometry["tokens_chunk_size"]
    num_tokens = num_latent_frames + geometry["token_drop"]
    pad_tokens = (-num_tokens) % chunk
    return pad_tokens, (num_tokens + pad_tokens) // chunk - int(geometry["token_drop"] > 0)


# the attributes AutoencoderKLMiniMaxH3 derives in __init__ and reads in `_decode`
_MODEL_ATTRIBUTES = ("tokens_chunk_size", "token_overlap", "frame_pre_padding", "frame_overlap")


def plan_clips(vae: Any, num_latent_frames: int) -> ClipPlan:
    """The clip plan of ``vae._decode`` on a latent video of ``num_latent_frames`` frames."""
    config = getattr(vae, "config", None)
    if config is None or not hasattr(config, "clip_length"):
        raise TypeError(f"plan_clips needs an AutoencoderKLMiniMaxH3 (a config with clip_length), "
                        f"got {type(vae).__name__}")
    if isinstance(num_latent_frames, bool) or not isinstance(num_latent_frames, int) or num_latent_frames < 1:
        raise ValueError(f"num_latent_frames must be a positive int, got {num_latent_frames!r}")
    geometry = _geometry(config)
    for name in _MODEL_ATTRIBUTES:
        if getattr(vae, name, geometry[name]) != geometry[name]:
            raise ValueError(f"{type(vae).__name__}.{name} is {getattr(vae, name)} but its config implies "
                             f"{geometry[name]}; the clip plan would not match the model's own _decode")
    pad_tokens, num_clips = _clip_count(num_latent_frames, geometry)
    if num_clips < 1:
        shortest = next(t for t in range(num_latent_frames, num_latent_frames + 4 * geometry["tokens_chunk_size"])
                        if _clip_count(t, geometry)[1] >= 1)
        raise ValueError(f"a latent video of {num_latent_frames} frames holds no whole clip for this VAE "
                         f"(clip_length={geometry['clip_length']}, token_drop={geometry['token_drop']}); "
                         f"it needs at least {shortest} latent frames")
    return ClipPlan(num_latent_frames=num_latent_frames, pad_tokens=pad_tokens, num_clips=num_clips, **geometry)


def owned_clips(plan: ClipPlan, rank: int, world_size: int) -> tuple[int, ...]:
    """Round-robin clip ownership: rank r decodes clips r, r + W, r + 2W, ... (none when r >= clips)."""
    return owned_units(plan.num_clips, rank, world_size)


def pad_latents(z: torch.Tensor, plan: ClipPlan) -> torch.Tensor:
    """z with its last latent frame repeated ``plan.pad_tokens`` times, as `_decode` pads it."""
    if z.ndim != 5 or z.shape[2] != plan.num_latent_frames:
        raise ValueError(f"latents of shape {tuple(z.shape)} do not match a plan for "
                         f"{plan.num_latent_frames} latent frames (batch, channels, frames, height, width)")
    if plan.pad_tokens == 0:
        return z
    return torch.cat([z, z[:, :, -1:].repeat(1, 1, plan.pad_tokens, 1, 1)], dim=2)


def window_latents(padded: torch.Tensor, plan: ClipPlan, clip: int) -> torch.Tensor:
    """The latent window clip ``clip`` decodes, sliced from the padded video like `_decode` slices it."""
    start, stop = plan.window(clip)
    return padded[:, :, start:stop]


def frame_sources(plan: ClipPlan, num_frames: int) -> list[tuple[int, ...]]:
    """The clip(s) each output pixel frame of `_decode` is made of, in order.

    Clip c's first chunk holds ``chunk_frames`` frames; its first ``frame_overlap`` frames are the
    cross-fade with clip c - 1's overlap chunk, whose weight on clip c is zero at the fade's first
    frame, so that frame is clip c - 1's alone. The frames past the last clip are its overlap tail.
    """
    sources: list[tuple[int, ...]] = []
    for frame in range(num_frames):
        clip, offset = divmod(frame, plan.chunk_frames)
        if clip >= plan.num_clips:
            sources.append((plan.num_clips - 1,))
        elif clip > 0 and offset < plan.frame_overlap:
            sources.append((clip - 1,) if offset == 0 else (clip - 1, clip))
        else:
            sources.append((clip,))
    return sources


@dataclass(frozen=True)
class TilePlan:
    """The spatial tile grid `_decode_clip` lays over one clip (pixel starts/lengths, as `_split_tiles` does)."""

    ratio: int  # pixels per latent pixel
    y_starts: tuple[int, ...]
    y_lengths: tuple[int, ...]
    x_starts: tuple[int, ...]
    x_lengths: tuple[int, ...]

    @property
    def num_tiles(self) -> int:
        return len(self.y_starts) * len(self.x_starts)

    @property
    def y_overlaps(self) -> tuple[int, ...]:
        """Pixels each row of tiles shares with the next, top to bottom: the seams the library's stitcher blends
        and crops, each by its own overlap (they differ where the grid's slack does not spread evenly)."""
        return _overlaps(self.y_starts, self.y_lengths)

    @property
    def x_overlaps(self) -> tuple[int, ...]:
        """Pixels each column of tiles shares with the next, left to right (see ``y_overlaps``)."""
        return _overlaps(self.x_starts, self.x_lengths)

    def latent_window(self, tile: int) -> tuple[slice, slice]:
        """Latent (row, column) slices of tile ``tile`` (row-major over the grid)."""
        if not 0 <= tile < self.num_tiles:
            raise ValueError(f"tile {tile} is outside this plan's {self.num_tiles} tiles")
        row, col = divmod(tile, len(self.x_starts))
        y, h = self.y_starts[row] // self.ratio, self.y_lengths[row] // self.ratio
        x, w = self.x_starts[col] // self.ratio, self.x_lengths[col] // self.ratio
        return slice(y, y + h), slice(x, x + w)


def _overlaps(starts: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(start + length - following
                 for start, length, following in zip(starts[:-1], lengths[:-1], starts[1:], strict=True))


def plan_tiles(vae: Any, latent_height: int, latent_width: int) -> TilePlan | None:
    """The tile grid of ``vae._decode_clip`` on latents of this size, from the library's own `_split_tiles`;
    None when tiling is off (a clip is one decoder call)."""
    if not getattr(vae, "use_tiling", False):
        return None
    ratio = int(vae.spatial_compression_ratio)
    y_starts, y_lengths, _ = type(vae)._split_tiles(vae, latent_height * ratio, vae.tile_sample_min_height,
                                                    vae.tile_sample_min_overlap_height)
    x_starts, x_lengths, _ = type(vae)._split_tiles(vae, latent_width * ratio, vae.tile_sample_min_width,
                                                    vae.tile_sample_min_overlap_width)
    return TilePlan(ratio, tuple(y_starts), tuple(y_lengths), tuple(x_starts), tuple(x_lengths))


def tile_latents(window: torch.Tensor, tiles: TilePlan, tile: int) -> torch.Tensor:
    """Tile ``tile`` of a clip's latent window, sliced like `_decode_clip` slices it."""
    rows, cols = tiles.latent_window(tile)
    return window[..., rows, cols]


def busiest_share(units: int, world_size: int) -> float:
    """The share of ``units`` equal work items the busiest of ``world_size`` round-robin ranks gets."""
    return math.ceil(units / world_size) / units


def choose_split(world_size: int, num_clips: int, num_tiles: int) -> str:
    """Shard whole clips, or every (clip, tile) pair: whichever leaves the busiest rank the smaller share
    of the decoder work; whole clips on a tie (fewer pieces to gather, no spatial stitching to serve)."""
    if num_tiles <= 1:
        return "clips"
    clips = busiest_share(num_clips, world_size)
    tiles = busiest_share(num_clips * num_tiles, world_size)
    return "tiles" if tiles < clips else "clips"


@dataclass(frozen=True)
class WorkPlan:
    """What one sharded `_decode` call splits: whole clips, or (clip, tile) units in clip-major order."""

    clips: ClipPlan
    tiles: TilePlan | None
    split: str  # "clips" or "tiles"

    @property
    def tiles_per_clip(self) -> int:
        return self.tiles.num_tiles if self.tiles is not None else 1

    @property
    def num_units(self) -> int:
        return self.clips.num_clips * (self.tiles_per_clip if self.split == "tiles" else 1)

    @property
    def decoder_calls(self) -> int:
        """Decoder forwards of the whole video (a clip is ``tiles_per_clip`` of them)."""
        return self.clips.num_clips * self.tiles_per_clip

    def unit(self, index: int) -> tuple[int, int | None]:
        """(clip, tile) of unit ``index``; tile None when whole clips are the units."""
        if not 0 <= index < self.num_units:
            raise ValueError(f"unit {index} is outside this plan's {self.num_units} units")
        if self.split == "clips":
            return index, None
        return divmod(index, self.tiles_per_clip)


def plan_work(vae: Any, z_shape: tuple[int, ...], world_size: int, split: str = "auto") -> WorkPlan:
    """The clip plan, the tile grid and the split of one `_decode` call on latents of ``z_shape``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    clips = plan_clips(vae, int(z_shape[2]))
    tiles = plan_tiles(vae, int(z_shape[3]), int(z_shape[4]))
    num_tiles = tiles.num_tiles if tiles is not None else 1
    if split == "tiles" and tiles is None:
        raise ValueError("split='tiles' needs tiling on (vae.enable_tiling()); with tiling off a clip is one "
                         "decoder call")
    chosen = choose_split(world_size, clips.num_clips, num_tiles) if split == "auto" else split
    return WorkPlan(clips, tiles, chosen)


def owned_units(num_units: int, rank: int, world_size: int) -> tuple[int, ...]:
    """Round-robin ownership of work units: rank r takes r, r + W, r + 2W, ... (none when r >= units)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size} ranks")
    return tuple(range(rank, num_units, world_size))
