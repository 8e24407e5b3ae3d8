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

__all__ = ["ClipPlan", "owned_clips", "pad_latents", "plan_clips", "window_latents"]


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
    """Round-robin ownership: rank r decodes clips r, r + W, r + 2W, ... (none when r >= clips)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size} ranks")
    return tuple(range(rank, plan.num_clips, world_size))


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
