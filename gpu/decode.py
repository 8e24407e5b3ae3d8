"""GPU tier of decode: a real MiniMax-H3 VAE sharded over every visible GPU (NCCL) vs the stock decode.

Bit-exact in fp32 and bf16 alike: the sharded path runs the same clip and tile decodes and the
library's own post-loop, so any difference is a bug, not rounding. On a GPU the model's own tile geometry
is kept (the tiny checkpoint has the released clip and tile geometry with shrunken channels), and each
latent frame is one latent pixel wider than a tile, so every clip is a 2 x 2 tile grid. On ``--device cpu``
(the dry run) the world is two gloo ranks, the video is the shortest of two clips, and the tiles are a
quarter of the released side with the released overlap ratio (64 pixels, 16 overlapping: still a 2 x 2
grid through the model's own tiling, at a sixteenth of the pixels, which on two CPU cores is the
difference between seconds and half a minute per encode).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from fixtures import decode_tasks
from harness.decode.judge import compare_sharded_decode
from harness.inputs import checkpoints
from harness.judging.checkid import CheckId
from harness.judging.checks import CheckContext
from harness.judging.compare import Verdict, exact
from harness.process import launch

__all__ = [
    "FP32_ONLY_CHECKS",
    "GPU_CHECKS",
    "CheckpointDecodeJob",
    "CheckpointEncodeJob",
    "decode_autocast_bitexact",
    "decode_bitexact",
    "decode_gather_to_one",
    "encode_bitexact",
    "gpu_id",
    "world_size",
]

DRY_RUN_WORLD = 2
LATENT_FRAMES = 22  # 4 clips on a GPU node: cross-fades exercised, 16 tile decodes to spread
DRY_RUN_LATENT_FRAMES = 8  # 2 clips (a padded tail) on the CPU: one cross-fade, 8 tile decodes
ENCODE_CLIPS = 2  # pixel clips of the encode check (the last one padded by repetition)
DRY_RUN_TILE = (64, 16)  # the dry run's tile side and minimum overlap in pixels: the released (256, 64) / 4


def tile_like_the_pipeline(vae: Any, dry_run: bool) -> Any:
    """Tiling on, as the pipeline decodes: the model's own geometry, or the dry run's smaller tiles."""
    if dry_run:
        side, overlap = DRY_RUN_TILE
        vae.enable_tiling(tile_sample_min_height=side, tile_sample_min_width=side,
                          tile_sample_min_overlap_height=overlap, tile_sample_min_overlap_width=overlap)
    else:
        vae.enable_tiling()
    return vae


@functools.cache
def _load_vae(path: str, dtype_name: str) -> Any:
    checkpoint = checkpoints.detect(path)
    return checkpoints.load_model(checkpoint, getattr(torch, dtype_name), "cpu")


@dataclass(frozen=True)
class CheckpointDecodeJob:
    """A real checkpoint decoding seeded latents; picklable, so spawned NCCL ranks rebuild it."""

    path: str
    dtype_name: str  # "float32" / "bfloat16"
    dry_run: bool
    frames: int = LATENT_FRAMES
    seed: int = 1234
    shard: bool = True
    transport: str = "all_gather"
    dst: int = 0
    split: str = "auto"
    autocast: str = ""

    def build_vae(self) -> Any:
        return tile_like_the_pipeline(_load_vae(self.path, self.dtype_name), self.dry_run)

    def latent_hw(self, vae: Any) -> int:
        """One latent pixel past a tile: the smallest frame the model splits into 2 x 2 tiles."""
        return vae.tile_sample_min_height // vae.spatial_compression_ratio + 1

    def build_latents(self, device: torch.device) -> torch.Tensor:
        vae = self.build_vae()
        side = self.latent_hw(vae)
        generator = torch.Generator().manual_seed(self.seed)
        z = torch.randn((1, vae.config.latent_channels, self.frames, side, side), generator=generator)
        return z.to(device=device, dtype=getattr(torch, self.dtype_name))


@dataclass(frozen=True)
class CheckpointEncodeJob:
    """A real checkpoint encoding a seeded pixel video of ENCODE_CLIPS clips, 2 x 2 tiles per frame."""

    path: str
    dtype_name: str
    frames: int
    dry_run: bool = False
    seed: int = 99
    transport: str = "all_gather"
    dst: int = 0
    autocast: str = ""

    def build_vae(self) -> Any:
        return tile_like_the_pipeline(_load_vae(self.path, self.dtype_name), self.dry_run)

    def build_video(self, device: torch.device) -> torch.Tensor:
        vae = self.build_vae()
        side = vae.tile_sample_min_height + vae.spatial_compression_ratio
        generator = torch.Generator().manual_seed(self.seed)
        x = torch.randn((1, vae.config.in_channels, self.frames, side, side), generator=generator)
        return x.to(device=device, dtype=getattr(torch, self.dtype_name))


def world_size(ctx: CheckContext) -> int:
    """Every rank of a torchrun launch; else every visible GPU on CUDA, two gloo ranks for the CPU dry run."""
    launched = launch.launched()
    if launched is not None:
        return launched.world_size
    if ctx.device.type == "cuda":
        count = torch.cuda.device_count()
        if count < 1:
            raise ValueError("the gpu decode check needs at least one visible CUDA device")
        return count
    return DRY_RUN_WORLD


def decode_bitexact(ctx: CheckContext) -> Verdict:
    """Every rank's sharded video bitwise equal to the stock decode in ctx.dtype, per-rank SHA-256 equal."""
    dry_run = ctx.device.type != "cuda"
    job = CheckpointDecodeJob(str(ctx.checkpoint), str(ctx.dtype).removeprefix("torch."), dry_run=dry_run,
                              frames=DRY_RUN_LATENT_FRAMES if dry_run else LATENT_FRAMES)
    world = ctx.world(world_size(ctx))
    return compare_sharded_decode(world, decode_tasks.decode_task, job, sharded=world.size > 1,
                                  policy=exact(), timeout_s=max(ctx.task_timeout_s, 600.0))


def _decode_job(ctx: CheckContext, **options: Any) -> CheckpointDecodeJob:
    dry_run = ctx.device.type != "cuda"
    return CheckpointDecodeJob(str(ctx.checkpoint), str(ctx.dtype).removeprefix("torch."), dry_run=dry_run,
                               frames=DRY_RUN_LATENT_FRAMES if dry_run else LATENT_FRAMES, **options)


def decode_gather_to_one(ctx: CheckContext) -> Verdict:
    """Gather-to-one onto the last rank: it holds the stock video bitwise, every other rank returns None."""
    world = ctx.world(world_size(ctx))
    job = _decode_job(ctx, transport="gather", dst=world.size - 1)
    return compare_sharded_decode(world, decode_tasks.decode_task, job, sharded=world.size > 1,
                                  policy=exact(), timeout_s=max(ctx.task_timeout_s, 600.0))


def decode_autocast_bitexact(ctx: CheckContext) -> Verdict:
    """Stock and sharded decode both under the pipeline's fp16 autocast: bitwise equal.

    The pipeline autocasts over fp32 weights; bf16 weights under fp16 autocast is no setup anyone runs (and
    the CPU's autocast refuses it), so the bf16 item skips in the parent, before any rank starts.
    """
    if ctx.dtype != torch.float32:
        pytest.skip(f"fp16 autocast runs over fp32 VAE weights (the pipeline's setup), not {ctx.dtype}")
    world = ctx.world(world_size(ctx))
    return compare_sharded_decode(world, decode_tasks.decode_task, _decode_job(ctx, autocast="float16"),
                                  sharded=world.size > 1, policy=exact(), timeout_s=max(ctx.task_timeout_s, 600.0))


def encode_bitexact(ctx: CheckContext) -> Verdict:
    """The sharded encode's moments bitwise equal to ``vae.encode``'s on every rank."""
    world = ctx.world(world_size(ctx))
    vae = _load_vae(str(ctx.checkpoint), str(ctx.dtype).removeprefix("torch."))
    job = CheckpointEncodeJob(str(ctx.checkpoint), str(ctx.dtype).removeprefix("torch."),
                              frames=ENCODE_CLIPS * vae.config.clip_length - 1, dry_run=ctx.device.type != "cuda")
    return compare_sharded_decode(world, decode_tasks.encode_task, job, sharded=world.size > 1,
                                  policy=exact(), timeout_s=max(ctx.task_timeout_s, 600.0))


def gpu_id(what: str) -> CheckId:
    """``decode.gpu.<what>``: the id of a gpu-tier decode check."""
    return CheckId("decode", "gpu", "", what)


# checks whose bf16 item skips (fp16 autocast runs over fp32 weights: decode_autocast_bitexact)
FP32_ONLY_CHECKS = (str(gpu_id("fp16_autocast")),)

# the gpu decode catalogue (gpu/checks.py registers each under its id, judged exactly)
GPU_CHECKS = {
    gpu_id("bitexact"): (decode_bitexact, "sharded decode over every visible GPU vs the stock decode: bitwise, "
                                          "rank SHA-256 equal"),
    gpu_id("gather_to_one"): (decode_gather_to_one, "gather-to-one onto the last rank: it holds the stock video "
                                                       "bitwise, every other rank returns None"),
    gpu_id("fp16_autocast"): (decode_autocast_bitexact, "stock and sharded decode under fp16 autocast: bitwise"),
    gpu_id("encode_bitexact"): (encode_bitexact, "sharded encode moments bitwise equal to vae.encode's"),
}
