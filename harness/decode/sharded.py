"""Stock and sharded MiniMax-H3 video decode, side by side with the same signature.

Under sequence parallelism every rank ends the denoise loop holding the same latents and would
decode the whole video itself. The sharded decode splits the independent, expensive temporal clip
decodes round-robin over the group (rank r decodes clips r, r + W, ...), all-gathers them behind a
fail-closed probe, and then runs the library's own `_decode` with its clip decoder served from the
gathered clips, so every rank ends with the whole video, bit-identical to ``vae.decode(z)``.

``decode_video`` is the opt-in entry: the flag defaults to off, and a world of one rank or no
initialised process group takes the stock call unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from harness.decode import exchange, serve
from harness.decode import plan as plan_mod
from harness.decode.exchange import ShardedDecodeError

__all__ = ["ShardedDecodeError", "decode_owned", "decode_video", "sharded_decode", "stock_decode",
           "takes_sharded_path"]


def _check_inputs(vae: Any, z: torch.Tensor) -> None:
    if not (callable(getattr(vae, "decode", None)) and callable(getattr(vae, "_decode_clip", None))
            and hasattr(getattr(vae, "config", None), "clip_length")):
        raise TypeError(f"expected an AutoencoderKLMiniMaxH3 (decode, _decode_clip, config.clip_length), "
                        f"got {type(vae).__name__}")
    if not isinstance(z, torch.Tensor) or z.ndim != 5 or not z.is_floating_point():
        shown = tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
        raise ValueError(f"latents must be a float tensor (batch, channels, frames, height, width), got {shown}")
    channels = vae.config.latent_channels
    if z.shape[1] != channels:
        raise ValueError(f"latents have {z.shape[1]} channels but the VAE decodes {channels} "
                         f"(shape {tuple(z.shape)}, expected (batch, {channels}, frames, height, width))")


def stock_decode(vae: Any, z: torch.Tensor) -> torch.Tensor:
    """The stock call: this process decodes every clip of the video."""
    _check_inputs(vae, z)
    return vae.decode(z).sample


def sharded_decode(vae: Any, z: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Decode ``z`` with the clips spread over ``group``; every rank returns the whole video.

    Every rank of the group must call this with the same latents. The library's ``decode`` wrapper
    (dtype alignment, batch slicing) runs unchanged; only its ``_decode`` is swapped for one call.
    """
    _check_inputs(vae, z)
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("sharded_decode needs an initialised torch.distributed process group; "
                         "decode_video falls back to the stock call without one")
    across = functools.partial(_decode_across_group, vae, group=group)
    with serve.bound(vae, "_decode", across):
        return vae.decode(z).sample


def takes_sharded_path(enabled: bool, group: dist.ProcessGroup | None = None) -> bool:
    """The gate: sharding only when asked for, with a group of more than one rank to share the clips."""
    if not enabled or not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size(group) > 1


def decode_video(vae: Any, z: torch.Tensor, *, shard_across_group: bool = False,
                 group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The opt-in entry: sharded when ``shard_across_group`` and the group has > 1 rank, else stock."""
    if not isinstance(shard_across_group, bool):
        raise TypeError(f"shard_across_group must be a bool, got {type(shard_across_group).__name__}")
    if takes_sharded_path(shard_across_group, group):
        return sharded_decode(vae, z, group)
    return stock_decode(vae, z)


def decode_owned(vae: Any, padded: torch.Tensor, plan: plan_mod.ClipPlan,
                 clips: Sequence[int]) -> tuple[list[torch.Tensor], BaseException | None]:
    """Decode this rank's clips with the model's own `_decode_clip`; stop at the first error.

    The error is returned, not raised: the rank must still join the probe exchange so the others
    learn of it and stop with it.
    """
    decoded: list[torch.Tensor] = []
    for clip in clips:
        try:
            decoded.append(vae._decode_clip(plan_mod.window_latents(padded, plan, clip)))
        except Exception as err:  # noqa: BLE001 - reported through the probe, re-raised below
            return decoded, err
    return decoded, None


def _decode_across_group(vae: Any, z: torch.Tensor, *, group: dist.ProcessGroup | None) -> torch.Tensor:
    """One `_decode(z)` call, sharded (bound over the instance's `_decode` by sharded_decode)."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    plan = plan_mod.plan_clips(vae, z.shape[2])
    padded = plan_mod.pad_latents(z, plan)
    mine = plan_mod.owned_clips(plan, rank, world_size)
    clips, failure = decode_owned(vae, padded, plan, mine)
    probe = exchange.make_probe(clips, failure is not None, z.device, latent_frames=plan.num_latent_frames)
    probes = exchange.exchange_probes(probe, group)
    try:
        shape, dtype = exchange.agree_on_shapes(probes, rank)
    except ShardedDecodeError as err:
        if failure is not None:
            raise ShardedDecodeError(f"{err}; this rank's decoder raised {type(failure).__name__}: {failure}") \
                from failure
        raise
    slots = max(len(plan_mod.owned_clips(plan, r, world_size)) for r in range(world_size))
    slabs = exchange.gather_clips(clips, slots, shape, dtype, z.device, group)
    ordered = exchange.order_gathered(slabs, plan, world_size)
    with serve.serve_clips(vae, padded, plan, ordered):
        return serve.run_post_loop(vae, z)
