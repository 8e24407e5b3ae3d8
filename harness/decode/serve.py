"""Run the library's own post-loops over pieces that were decoded (or encoded) elsewhere.

The stock `_decode` pads, calls `self._decode_clip` once per clip window, cross-fades, trims and
concatenates; `_decode_clip` itself splits a clip into spatial tiles, runs
`self.decoder(self.post_quant_conv(tile))` per tile and stitches them with `_stitch_tiles`/`_blend`;
`_encode` pads, calls `self._encode_clip` per clip and concatenates under its token-drop rule. Rather
than re-typing any of that, the sharded path binds a server on the instance for one call: whole
clips are served in place of `_decode_clip` (or `_encode_clip`), tiles in place of `decoder` (with
`post_quant_conv` passing the tile through, since it ran where the tile was decoded). Each call is
answered with the next gathered piece after checking that the input the library passed is the one
the plan computed; so every blend, stitch, trim and concat is the installed library's, and any drift
between the plan and the library stops with an error instead of a silently misplaced piece.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from harness.decode import plan as plan_mod
from harness.decode.exchange import ShardedDecodeError

__all__ = ["ClipServer", "PieceServer", "bound", "run_encode_post_loop", "run_post_loop", "same_bits", "serve_clips",
           "serve_encode_clips", "serve_tiles"]

_MISSING = object()
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same values bit for bit: dtype, shape and every element's bit pattern.

    Not ``torch.equal``: NaN != NaN there, so a latent holding a NaN would read as a plan mismatch, and
    -0.0 == 0.0 would let a different input pass. A complex element is compared as its two real parts.
    """
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.is_complex():
        a, b = torch.view_as_real(a.resolve_conj()), torch.view_as_real(b.resolve_conj())
    bits = _BITS[a.element_size()]  # every real dtype's item is 1, 2, 4 or 8 bytes
    return torch.equal(a.view(bits), b.view(bits))  # same item size: a view of any strides


@contextlib.contextmanager
def bound(obj: Any, name: str, value: Callable[..., Any]) -> Iterator[None]:
    """Bind ``value`` as an instance attribute for the duration, restoring what was there before."""
    previous = obj.__dict__.get(name, _MISSING)
    obj.__dict__[name] = value
    try:
        yield
    finally:
        if previous is _MISSING:
            obj.__dict__.pop(name, None)
        else:
            obj.__dict__[name] = previous


class PieceServer:
    """Stands in for one library call site: answers call i with gathered piece i after checking its input.

    ``expected(i)`` is the input the plan says call i receives; ``what`` names the call site in errors.
    """

    def __init__(self, expected: Callable[[int], torch.Tensor], pieces: Sequence[torch.Tensor], what: str):
        self.expected = expected
        self.pieces = list(pieces)
        self.what = what
        self.served = 0

    def __call__(self, given: torch.Tensor) -> torch.Tensor:
        index = self.served
        if index >= len(self.pieces):
            raise ShardedDecodeError(f"the library asked {self.what} for piece {index} but only {len(self.pieces)} "
                                     "were gathered; the installed VAE no longer matches the plan")
        expected = self.expected(index)
        if not same_bits(given, expected):
            raise ShardedDecodeError(f"the library's {self.what} call {index} passed an input of shape "
                                     f"{tuple(given.shape)} that is not the planned one of shape "
                                     f"{tuple(expected.shape)}; the installed VAE no longer matches the plan")
        self.served += 1
        return self.pieces[index]

    def finish(self) -> None:
        if self.served != len(self.pieces):
            raise ShardedDecodeError(f"the library used {self.served} of the {len(self.pieces)} gathered pieces "
                                     f"at {self.what}; the installed VAE no longer matches the plan")


class ClipServer(PieceServer):
    """Stands in for `_decode_clip`: answers call i with gathered clip i after verifying its latent window."""

    def __init__(self, padded: torch.Tensor, plan: plan_mod.ClipPlan, clips: Sequence[torch.Tensor]):
        if len(clips) != plan.num_clips:
            raise ShardedDecodeError(f"{len(clips)} clips were gathered for a plan of {plan.num_clips} clips; "
                                     "refusing to run the post-loop on them")
        super().__init__(lambda clip: plan_mod.window_latents(padded, plan, clip), clips, "_decode_clip")
        self.plan = plan


@contextlib.contextmanager
def serve_clips(vae: Any, padded: torch.Tensor, plan: plan_mod.ClipPlan,
                clips: Sequence[torch.Tensor]) -> Iterator[ClipServer]:
    """Bind a ClipServer over ``vae._decode_clip`` for the duration; check every clip was used."""
    server = ClipServer(padded, plan, clips)
    with bound(vae, "_decode_clip", server):
        yield server
    server.finish()


def _pass_through(tile: torch.Tensor) -> torch.Tensor:
    return tile


@contextlib.contextmanager
def serve_tiles(vae: Any, padded: torch.Tensor, work: plan_mod.WorkPlan,
                tiles: Sequence[torch.Tensor]) -> Iterator[PieceServer]:
    """Serve gathered tiles in place of ``vae.decoder``, in the library's own `_decode_clip` loop order
    (clip-major, then row-major tiles); ``post_quant_conv`` passes each tile through, since it already ran
    where the tile was decoded. The library's `_decode_clip` then stitches them with its own `_stitch_tiles`."""
    grid = work.tiles
    if grid is None or len(tiles) != work.num_units:
        raise ShardedDecodeError(f"{len(tiles)} tiles were gathered for a plan of {work.num_units}; refusing to "
                                 "run the post-loop on them")
    per_clip = grid.num_tiles

    def expected(index: int) -> torch.Tensor:
        clip, tile = divmod(index, per_clip)
        return plan_mod.tile_latents(plan_mod.window_latents(padded, work.clips, clip), grid, tile)

    server = PieceServer(expected, tiles, "decoder (one tile)")
    with bound(vae, "post_quant_conv", _pass_through), bound(vae, "decoder", server):
        yield server
    server.finish()


@contextlib.contextmanager
def serve_encode_clips(vae: Any, padded: torch.Tensor, clip_length: int,
                       moments: Sequence[torch.Tensor]) -> Iterator[PieceServer]:
    """Serve gathered clip moments in place of ``vae._encode_clip`` (window i: pixel frames [iL, (i+1)L))."""

    def expected(index: int) -> torch.Tensor:  # a single frame is window 0 whole: the slice holds all of it
        return padded[:, :, index * clip_length:(index + 1) * clip_length]

    server = PieceServer(expected, moments, "_encode_clip")
    with bound(vae, "_encode_clip", server):
        yield server
    server.finish()


def run_post_loop(vae: Any, z: torch.Tensor) -> torch.Tensor:
    """The library's own `_decode` (class attribute: an instance binding may be the sharded one)."""
    return type(vae)._decode(vae, z)


def run_encode_post_loop(vae: Any, x: torch.Tensor) -> torch.Tensor:
    """The library's own `_encode` (its concatenation and token-drop rule) over served clip moments."""
    return type(vae)._encode(vae, x)
