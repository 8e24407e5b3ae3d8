"""Run the library's own `_decode` post-loop over clips that were decoded elsewhere.

The stock `_decode` pads, calls `self._decode_clip` once per clip window, cross-fades, trims and
concatenates. Rather than re-typing that loop, the sharded decode binds a clip server over
`_decode_clip` on the instance for one call: each call is answered with the next gathered clip,
after checking that the latent window the stock loop asked for is the one the plan decoded. So the
blend/trim/concat is the installed library's, and any drift between the plan and the library stops
with an error instead of a silently misplaced clip.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from harness.decode import plan as plan_mod
from harness.decode.exchange import ShardedDecodeError

__all__ = ["ClipServer", "bound", "run_post_loop", "serve_clips"]

_MISSING = object()


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


class ClipServer:
    """Stands in for `_decode_clip`: answers call i with gathered clip i after verifying its window."""

    def __init__(self, padded: torch.Tensor, plan: plan_mod.ClipPlan, clips: Sequence[torch.Tensor]):
        if len(clips) != plan.num_clips:
            raise ShardedDecodeError(f"{len(clips)} clips were gathered for a plan of {plan.num_clips} clips; "
                                     "refusing to run the post-loop on them")
        self.padded = padded
        self.plan = plan
        self.clips = list(clips)
        self.served = 0

    def __call__(self, window: torch.Tensor) -> torch.Tensor:
        clip = self.served
        if clip >= self.plan.num_clips:
            raise ShardedDecodeError(f"the stock _decode asked for clip {clip} but the plan has only "
                                     f"{self.plan.num_clips}; the installed _decode no longer matches the plan")
        expected = plan_mod.window_latents(self.padded, self.plan, clip)
        if window.shape != expected.shape or not torch.equal(window, expected):
            start, stop = self.plan.window(clip)
            raise ShardedDecodeError(f"the stock _decode's clip call {clip} passed latents of shape "
                                     f"{tuple(window.shape)} that are not the planned window [{start}, {stop}) "
                                     f"of shape {tuple(expected.shape)}; the installed _decode no longer matches "
                                     "the plan")
        self.served += 1
        return self.clips[clip]

    def finish(self) -> None:
        if self.served != self.plan.num_clips:
            raise ShardedDecodeError(f"the stock _decode used {self.served} of {self.plan.num_clips} gathered "
                                     "clips; the installed _decode no longer matches the plan")


@contextlib.contextmanager
def serve_clips(vae: Any, padded: torch.Tensor, plan: plan_mod.ClipPlan,
                clips: Sequence[torch.Tensor]) -> Iterator[ClipServer]:
    """Bind a ClipServer over ``vae._decode_clip`` for the duration; check every clip was used."""
    server = ClipServer(padded, plan, clips)
    with bound(vae, "_decode_clip", server):
        yield server
    server.finish()


def run_post_loop(vae: Any, z: torch.Tensor) -> torch.Tensor:
    """The library's own `_decode` (class attribute: an instance binding may be the sharded one)."""
    return type(vae)._decode(vae, z)
