"""The decode plan against the library's own `_decode` call sequence (an oracle independent of the fast path).

The sharded decode trusts harness.decode.plan for where each clip and tile reads its latents and for
which clips each output frame is made of (the labels of every failure message). Here the STOCK
`vae.decode` runs under spies: the latent windows it hands `_decode_clip`, the tiles it hands
`post_quant_conv` inside each clip, and, with every clip's decode replaced by a constant 4**clip,
the value of each output frame (4**c alone, or strictly between 4**c and 4**(c+1) where clips c and
c + 1 are cross-faded). Each observation is compared with what the plan says.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from harness.decode import plan as plan_mod
from harness.decode import serve
from harness.judging.compare import Verdict, holds

__all__ = ["judge_plan_against_library", "observe_stock_decode"]


def _observed_sources(video: torch.Tensor) -> list[tuple[int, ...]]:
    """Each frame's source clips from a decode whose clip c was the constant 4**c."""
    sources = []
    for frame in range(video.shape[2]):
        values = video[:, :, frame].double()
        value = float(values.flatten()[0])
        if not torch.all(values == value) or value < 1:
            sources.append((-1,))  # not one constant: the frame mixes something the plan cannot name
            continue
        clip = math.floor(math.log(value, 4) + 1e-9)
        sources.append((clip,) if value == 4.0 ** clip else (clip, clip + 1))
    return sources


def observe_stock_decode(vae: Any, z: torch.Tensor) -> dict[str, Any]:
    """Run the stock decode under spies: clip windows, per-clip tile inputs, and each frame's source clips."""
    windows: list[torch.Tensor] = []
    tiles: list[list[torch.Tensor]] = []
    clip_fn, conv = vae._decode_clip, vae.post_quant_conv

    def record_clip(window: torch.Tensor) -> torch.Tensor:
        windows.append(window.clone())
        tiles.append([])
        return clip_fn(window)

    def record_tile(tile: torch.Tensor) -> torch.Tensor:
        tiles[-1].append(tile.clone())
        return conv(tile)

    with torch.no_grad(), serve.bound(vae, "_decode_clip", record_clip), serve.bound(vae, "post_quant_conv",
                                                                                      record_tile):
        video = type(vae)._decode(vae, z)  # `decode` reads post_quant_conv's dtype first; z is already in it
    shape = None
    calls = [0]

    def constant_clip(window: torch.Tensor) -> torch.Tensor:
        nonlocal shape
        if shape is None:
            shape = clip_fn(window).shape
        value = 4.0 ** calls[0]
        calls[0] += 1
        return torch.full(shape, value, dtype=torch.float64)

    with torch.no_grad(), serve.bound(vae, "_decode_clip", constant_clip):  # float64 clips: z's dtype is not read
        labelled = type(vae)._decode(vae, z)
    return {"windows": windows, "tiles": tiles, "frames": video.shape[2], "sources": _observed_sources(labelled)}


def judge_plan_against_library(cases: Sequence[tuple[Any, torch.Tensor]]) -> Verdict:
    """For each (vae, z): the plan's clip windows, tile windows and frame sources equal the library's own."""
    bad_windows: list[str] = []
    bad_tiles: list[str] = []
    bad_sources: list[str] = []
    for vae, z in cases:
        name = f"t{z.shape[2]} {tuple(z.shape[3:])} tiling={'on' if vae.use_tiling else 'off'}"
        seen = observe_stock_decode(vae, z)
        _, _, frames, height, width = z.shape  # what is decoded where: no split or world enters
        clips, tiles = plan_mod.plan_clips(vae, frames), plan_mod.plan_tiles(vae, height, width)
        padded = plan_mod.pad_latents(z, clips)
        planned = [plan_mod.window_latents(padded, clips, c) for c in range(clips.num_clips)]
        if len(planned) != len(seen["windows"]) or not all(
                a.shape == b.shape and torch.equal(a, b) for a, b in zip(planned, seen["windows"], strict=False)):
            bad_windows.append(f"{name}: plan {len(planned)} clips, library {len(seen['windows'])}")
        per_clip = [plan_mod.tile_latents(w, tiles, t) for w in planned for t in range(tiles.num_tiles)] \
            if tiles is not None else list(planned)
        observed = [t for clip in seen["tiles"] for t in clip]
        if len(per_clip) != len(observed) or not all(
                a.shape == b.shape and torch.equal(a, b) for a, b in zip(per_clip, observed, strict=False)):
            bad_tiles.append(f"{name}: plan {len(per_clip)} tiles, library {len(observed)}")
        sources = plan_mod.frame_sources(clips, seen["frames"])
        wrong = [f for f, (a, b) in enumerate(zip(sources, seen["sources"], strict=True)) if a != b]
        if wrong:
            f = wrong[0]
            bad_sources.append(f"{name}: {len(wrong)} frames, first {f}: plan {sources[f]}, library "
                               f"{seen['sources'][f]}")
    verdict = holds(not bad_windows, "the plan's clip windows are the ones the library's _decode asks for",
                    cases=len(cases), window_mismatches=bad_windows or "none")
    verdict = verdict.require(not bad_tiles, "the plan's tile windows are the ones the library's _decode_clip cuts",
                              tile_mismatches=bad_tiles or "none")
    return verdict.require(not bad_sources, "every output frame's source clips match the library's cross-fade",
                           source_mismatches=bad_sources or "none")
