"""Stock and sharded MiniMax-H3 video decode and encode, side by side with the same signatures.

Under sequence parallelism every rank ends the denoise loop holding the same latents and would
decode the whole video itself. The sharded decode splits the decoder work of one `_decode` call over
the group: whole clips (rank r decodes clips r, r + W, ...) or, when that leaves ranks idle or uneven
(W > clips, W not dividing them), every (clip, tile) pair of the clips' spatial tile grids
(plan.choose_split). The pieces travel behind the fail-closed exchange (exchange.py) by all-gather
(every rank returns the video) or gather to one rank (the others return None), and then the
library's own `_decode` runs with its clip decoder, or its tile decoder, served from the gathered
pieces: the result is bit-identical to ``vae.decode(z)``. The sharded encode does the same for
`_encode` over `_encode_clip`.

``decode_video`` is the opt-in entry: the flag defaults to off, and a world of one rank or no
initialised process group takes the stock call unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from harness.decode import exchange, serve
from harness.decode import plan as plan_mod
from harness.decode.exchange import ShardedDecodeError
from harness.process import progress

__all__ = ["ShardedDecodeError", "decode_pieces", "decode_unit", "decode_video", "sharded_decode", "sharded_encode",
           "stock_decode", "stock_encode", "takes_sharded_path"]


def _check_vae(vae: Any) -> None:
    if not (callable(getattr(vae, "decode", None)) and callable(getattr(vae, "_decode_clip", None))
            and hasattr(getattr(vae, "config", None), "clip_length")):
        raise TypeError(f"expected an AutoencoderKLMiniMaxH3 (decode, _decode_clip, config.clip_length), "
                        f"got {type(vae).__name__}")


def _check_video(x: Any, what: str, channels: int, layout: str) -> None:
    if not isinstance(x, torch.Tensor) or x.ndim != 5 or not x.is_floating_point():
        shown = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{what} must be a float tensor {layout}, got {shown}")
    if x.shape[1] != channels:
        raise ValueError(f"{what} have {x.shape[1]} channels but the VAE takes {channels} "
                         f"(shape {tuple(x.shape)}, expected {layout.replace('channels', str(channels))})")


def _check_inputs(vae: Any, z: torch.Tensor) -> None:
    _check_vae(vae)
    _check_video(z, "latents", vae.config.latent_channels, "(batch, channels, frames, height, width)")


def _check_transport(transport: str, dst: int, group: dist.ProcessGroup | None) -> None:
    if transport not in exchange.TRANSPORTS:
        raise ValueError(f"transport must be one of {exchange.TRANSPORTS}, got {transport!r}")
    world = dist.get_world_size(group)
    if isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < world:
        raise ValueError(f"dst must be a rank of the {world}-rank group, got {dst!r}")


def _require_group(group: Any, what: str) -> None:
    """An initialised torch.distributed and an explicit group: ``None`` would silently mean the default group, which
    is rarely the sequence-parallel group a trainer decodes in."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("the sharded decode/encode needs an initialised torch.distributed process group; "
                         "decode_video falls back to the stock call without one")
    if group is None:
        raise ValueError(f"{what}: group is None; pass the process group whose ranks share the work "
                         "(torch.distributed.group.WORLD for every rank of the default group)")


def stock_decode(vae: Any, z: torch.Tensor) -> torch.Tensor:
    """The stock call: this process decodes every clip of the video."""
    _check_inputs(vae, z)
    return vae.decode(z).sample


def stock_encode(vae: Any, x: torch.Tensor) -> Any:
    """The stock call: this process encodes every clip; the posterior (its ``parameters`` are the moments)."""
    _check_vae(vae)
    _check_video(x, "videos", vae.config.in_channels, "(batch, channels, frames, height, width)")
    return vae.encode(x).latent_dist


def sharded_decode(vae: Any, z: torch.Tensor, group: dist.ProcessGroup, *,
                   transport: str = "all_gather", dst: int = 0, split: str = "auto") -> torch.Tensor | None:
    """Decode ``z`` with the decoder work spread over ``group``.

    Every rank of the group must call this with the same latents. ``group`` is the process group whose ranks share
    the work (``torch.distributed.group.WORLD`` for the default one; None is refused, never read as "the world").
    With ``transport="all_gather"`` every rank returns the whole video; with ``"gather"`` only the rank whose rank
    in ``group`` is ``dst`` does and the others return None. ``split`` is "auto" (plan.choose_split), "clips" or
    "tiles". The library's ``decode`` wrapper (dtype alignment, batch slicing) runs unchanged; only its ``_decode``
    is swapped.
    """
    _check_inputs(vae, z)
    _require_group(group, "sharded_decode")
    _check_transport(transport, dst, group)
    across = functools.partial(_decode_across_group, vae, group=group, transport=transport, dst=dst, split=split)
    with serve.bound(vae, "_decode", across):
        video = vae.decode(z).sample
    target = exchange.destination(dst, dist.get_world_size(group))
    return video if exchange.receives(dist.get_rank(group), transport, target) else None


def sharded_encode(vae: Any, x: torch.Tensor, group: dist.ProcessGroup, *,
                   transport: str = "all_gather", dst: int = 0) -> Any:
    """Encode ``x`` with its `_encode_clip` calls spread over ``group``; the posterior like ``vae.encode(x)``'s
    (None on ranks that receive nothing under ``transport="gather"``)."""
    _check_vae(vae)
    _check_video(x, "videos", vae.config.in_channels, "(batch, channels, frames, height, width)")
    _require_group(group, "sharded_encode")
    _check_transport(transport, dst, group)
    across = functools.partial(_encode_across_group, vae, group=group, transport=transport, dst=dst)
    with serve.bound(vae, "_encode", across):
        posterior = vae.encode(x).latent_dist
    target = exchange.destination(dst, dist.get_world_size(group))
    return posterior if exchange.receives(dist.get_rank(group), transport, target) else None


def takes_sharded_path(enabled: bool, group: dist.ProcessGroup | None = None) -> bool:
    """The gate: sharding only when asked for, with a group of more than one rank to share the work."""
    if not enabled or not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size(group) > 1


def decode_video(vae: Any, z: torch.Tensor, *, shard_across_group: bool = False,
                 group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The opt-in entry: sharded when ``shard_across_group`` and ``group`` has > 1 rank, else stock. Sharding in an
    initialised world needs the group named (``torch.distributed.group.WORLD`` for the default one)."""
    if not isinstance(shard_across_group, bool):
        raise TypeError(f"shard_across_group must be a bool, got {type(shard_across_group).__name__}")
    if shard_across_group and group is None and dist.is_available() and dist.is_initialized():
        raise ValueError("decode_video(shard_across_group=True): group is None; pass the process group whose ranks "
                         "share the work (torch.distributed.group.WORLD for every rank of the default group)")
    if takes_sharded_path(shard_across_group, group):
        video = sharded_decode(vae, z, group)
        assert video is not None  # all-gather: every rank holds the video
        return video
    return stock_decode(vae, z)


def decode_pieces(compute: Callable[[int], torch.Tensor],
                  units: Sequence[int]) -> tuple[list[torch.Tensor], BaseException | None]:
    """Compute this rank's pieces in order; stop at the first error.

    The error is returned, not raised: the rank must still join the probe exchange so the others
    learn of it and stop with it.
    """
    pieces: list[torch.Tensor] = []
    for unit in units:
        try:
            pieces.append(compute(unit))
        except Exception as err:  # noqa: BLE001 - reported through the probe, re-raised there
            return pieces, err
    return pieces, None


def _across_group(compute: Callable[[int], torch.Tensor], num_units: int, length: int,
                  assemble: Callable[[list[torch.Tensor]], torch.Tensor], device: torch.device,
                  group: dist.ProcessGroup | None, transport: str, dst: int) -> torch.Tensor | None:
    """Compute owned pieces, agree, gather, assemble: the fail-closed sequence every rank runs whole."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    target = exchange.destination(dst, world_size)
    owned = plan_mod.owned_units(num_units, rank, world_size)
    slots = max(len(plan_mod.owned_units(num_units, r, world_size)) for r in range(world_size))
    progress.note(f"computing its pieces {list(owned)} of {num_units}, before the probe exchange")
    pieces, failure = decode_pieces(compute, owned)
    probe = exchange.make_probe(pieces, failure is not None, device, latent_frames=length, units=num_units)
    probes = exchange.exchange_probes(probe, group)
    try:
        shape, dtype = exchange.agree_on_shapes(probes, rank)
    except ShardedDecodeError as err:
        if failure is not None:
            raise ShardedDecodeError(f"{err}; this rank's decoder raised {type(failure).__name__}: {failure}") \
                from failure
        raise
    receiving = exchange.receives(rank, transport, target)
    payload: torch.Tensor | None = None
    received: list[torch.Tensor] | None = None
    failure = None
    try:
        payload, received = exchange.prepare_gather(pieces, slots, shape, dtype, device,
                                                    world_size, receiving)
    except Exception as err:  # noqa: BLE001 - reported through the status exchange
        failure = err
    exchange.confirm("gather", failure, rank, device, group)
    assert payload is not None
    result: torch.Tensor | None = None
    failure = None
    try:  # the payload collective and what follows it on this rank sit inside the protocol: a local failure
        # in either reaches every rank through the assemble status, never leaving the others in a collective
        slabs = exchange.collect(payload, received, transport, target, group)
        if receiving:
            assert slabs is not None
            result = assemble(exchange.order_units(slabs, num_units, world_size))
    except Exception as err:  # noqa: BLE001 - reported through the status exchange
        failure = err
    exchange.confirm("assemble", failure, rank, device, group)
    return result


def decode_unit(vae: Any, padded: torch.Tensor, work: Any, unit: int) -> torch.Tensor:
    """One unit of the plan decoded by the VAE's own modules: a whole clip, or one (clip, tile) pair."""
    clip, tile = work.unit(unit)
    window = plan_mod.window_latents(padded, work.clips, clip)
    if tile is None:
        return vae._decode_clip(window)
    assert work.tiles is not None
    return vae.decoder(vae.post_quant_conv(plan_mod.tile_latents(window, work.tiles, tile)))


def _decode_across_group(vae: Any, z: torch.Tensor, *, group: dist.ProcessGroup | None, transport: str, dst: int,
                         split: str) -> torch.Tensor:
    """One `_decode(z)` call, sharded (bound over the instance's `_decode` by sharded_decode)."""
    work = plan_mod.plan_work(vae, tuple(z.shape), dist.get_world_size(group), split)
    padded = plan_mod.pad_latents(z, work.clips)

    def compute(unit: int) -> torch.Tensor:
        return decode_unit(vae, padded, work, unit)

    def assemble(pieces: list[torch.Tensor]) -> torch.Tensor:
        if work.split == "tiles":
            with serve.serve_tiles(vae, padded, work, pieces):
                return serve.run_post_loop(vae, z)
        with serve.serve_clips(vae, padded, work.clips, pieces):
            return serve.run_post_loop(vae, z)

    video = _across_group(compute, work.num_units, work.clips.num_latent_frames, assemble, z.device, group,
                          transport, dst)
    return video if video is not None else z.new_empty(0)


def _encode_across_group(vae: Any, x: torch.Tensor, *, group: dist.ProcessGroup | None, transport: str,
                         dst: int) -> torch.Tensor:
    """One `_encode(x)` call, its clips sharded (bound over the instance's `_encode` by sharded_encode)."""
    clip_length = int(vae.config.clip_length)
    frames = x.shape[2]
    if frames == 1:
        padded, num_clips = x, 1
    else:
        pad = (-frames) % clip_length
        padded = torch.cat([x, x[:, :, -1:].repeat(1, 1, pad, 1, 1)], dim=2) if pad else x
        num_clips = padded.shape[2] // clip_length

    def compute(clip: int) -> torch.Tensor:
        if frames == 1:
            return vae._encode_clip(padded)
        return vae._encode_clip(padded[:, :, clip * clip_length:(clip + 1) * clip_length])

    def assemble(moments: list[torch.Tensor]) -> torch.Tensor:
        with serve.serve_encode_clips(vae, padded, clip_length, moments):
            return serve.run_encode_post_loop(vae, x)

    moments = _across_group(compute, num_clips, frames, assemble, x.device, group, transport, dst)
    if moments is None:
        return x.new_zeros((x.shape[0], 2 * vae.config.latent_channels, 0, 1, 1))
    return moments
