"""MiniMax-H3's video VAE decode spread over the sequence-parallel group: every rank decodes the clips dealt to it
(round robin), the ranks agree that everyone succeeded, all-gather the clips, and every rank runs the library's own
``_decode`` with its clip decoder served from them. Every rank ends with the whole video; there is no
gather-to-one, and a sliced batch decode is not sharded (both are refused, on every rank alike, before any
collective)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SequenceParallelDecodeError", "SequenceParallelVAEDecoder"]

_PROBE = 10  # ok, clips, latent elements, clip dtype, clip dims, then up to 5 dims of the clip's shape
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class SequenceParallelDecodeError(RuntimeError):
    """The group could not decode the video together; raised on every rank."""


def _windows(vae: Any, z: torch.Tensor) -> list[torch.Tensor]:
    """The latent window of every clip the library's ``_decode`` will ask for, in order (its chunking: chunks of
    ``tokens_chunk_size`` latent frames, ``token_overlap`` more each, the tail padded by repeating the last frame)."""
    chunk, drop = vae.tokens_chunk_size, vae.config.token_drop
    tokens = z.shape[2] + drop
    pad = (-tokens) % chunk
    if pad:
        z = torch.cat([z, z[:, :, -1:].repeat(1, 1, pad, 1, 1)], dim=2)
    clips = (tokens + pad) // chunk - int(drop > 0)
    return [z[:, :, i * chunk: i * chunk + chunk + vae.token_overlap] for i in range(clips)]


class SequenceParallelVAEDecoder:
    """Decode with the work of one video spread over ``group`` (every rank calls ``decode`` with the same latents)."""

    def __init__(self, vae: Any, group: Any) -> None:
        if group is None:
            raise ValueError("SequenceParallelVAEDecoder needs the sequence-parallel process group")
        self.vae, self.group = vae, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        if self.vae.use_slicing and z.shape[0] > 1:
            raise NotImplementedError("SequenceParallelVAEDecoder shards one _decode call: disable use_slicing")
        with self._served():
            return self.vae.decode(z).sample

    @contextlib.contextmanager
    def _served(self) -> Iterator[None]:
        self.vae._decode = self._decode  # decode()'s dtype alignment and hooks run as they are
        try:
            yield
        finally:
            del self.vae._decode

    def _decode(self, z: torch.Tensor) -> torch.Tensor:
        windows = _windows(self.vae, z)
        mine: list[torch.Tensor] = []
        error: BaseException | None = None
        try:
            mine = [self.vae._decode_clip(windows[i]) for i in range(self.rank, len(windows), self.world)]
        except Exception as err:  # noqa: BLE001 - the others must hear of it before they gather
            error = err
        shape = tuple(mine[0].shape) if mine else ()
        if any(tuple(clip.shape) != shape or clip.dtype != mine[0].dtype for clip in mine):
            error = error or SequenceParallelDecodeError(f"rank {self.rank} decoded clips of several shapes")
        dtype = _DTYPES.index(mine[0].dtype) + 1 if mine else 0
        try:
            probes = self._agree(error is None, len(windows), z.numel(), dtype, shape)
        except SequenceParallelDecodeError as failure:
            if error is not None:  # this rank's own failure is the cause the others were told of
                raise failure from error
            raise
        clips = self._gather(mine, len(windows), probes, z.device)
        served = iter(range(len(windows)))

        def decode_clip(window: torch.Tensor) -> torch.Tensor:
            index = next(served)
            if window.shape != windows[index].shape:
                raise SequenceParallelDecodeError(f"the library asked for clip {index} at {tuple(window.shape)}; "
                                                  f"the plan decoded {tuple(windows[index].shape)}")
            return clips[index]

        self.vae._decode_clip = decode_clip
        try:
            return type(self.vae)._decode(self.vae, z)
        finally:
            del self.vae._decode_clip

    def _agree(self, ok: bool, clips: int, elements: int, dtype: int, shape: tuple[int, ...]) -> list[list[int]]:
        """Every rank's (ok, clips, latent elements, clip dtype and shape), gathered before any clip moves: a rank that
        failed or sees another video makes every rank raise here, instead of leaving the others in the payload
        gather."""
        probe = torch.zeros(_PROBE, dtype=torch.int64)
        probe[:5] = torch.tensor([int(ok), clips, elements, dtype, len(shape)])
        probe[5:5 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
        gathered = [torch.zeros_like(probe) for _ in range(self.world)]
        dist.all_gather(gathered, probe, group=self.group)
        rows = [p.tolist() for p in gathered]
        failed = [r for r, p in enumerate(rows) if not p[0]]
        if failed:
            raise SequenceParallelDecodeError(f"rank(s) {failed} of the sequence-parallel group could not decode "
                                              f"their clips")
        if len({(p[1], p[2]) for p in rows}) > 1 or len({tuple(p[3:]) for p in rows if p[3]}) > 1:
            raise SequenceParallelDecodeError(f"the ranks disagree on the video: (clips, latent elements, clip "
                                              f"shape) per rank {[(p[1], p[2], p[5:5 + p[4]]) for p in rows]}")
        return rows

    def _gather(self, mine: list[torch.Tensor], clips: int, probes: list[list[int]],
                device: torch.device) -> list[torch.Tensor]:
        """Every clip, in order, from the all-gathered per-rank stacks (sent as bytes: any dtype, bit for bit)."""
        code, shape = next((p[3], tuple(p[5:5 + p[4]])) for p in probes if p[3])
        dtype = _DTYPES[code - 1]
        most = -(-clips // self.world)
        stack = torch.zeros(most, *shape, dtype=dtype, device=device)
        for k, clip in enumerate(mine):
            stack[k] = clip.to(dtype)
        payload = stack.reshape(-1).view(torch.uint8)
        gathered = [torch.empty_like(payload) for _ in range(self.world)]
        dist.all_gather(gathered, payload, group=self.group)
        stacks = [g.view(dtype).reshape(most, *shape) for g in gathered]
        return [stacks[i % self.world][i // self.world] for i in range(clips)]
