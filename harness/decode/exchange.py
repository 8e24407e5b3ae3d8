"""The collectives of the sharded decode: a fixed-size probe, then the clip payload.

Fail closed: before any rank sends a clip, every rank all-gathers a small probe of fixed size
(status, clip count, latent length, dtype, clip shape). Agreement is derived from ALL the gathered probes, so a
decoder error or a ragged clip on one rank makes every rank raise the same error together, instead
of the healthy ranks entering a payload all-gather the failed rank never joins (a 30-minute NCCL
timeout in a real job). Only after agreement do ranks exchange their clips, padded to one slab size.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from harness.decode import plan as plan_mod

__all__ = [
    "PROBE_DIMS",
    "Probe",
    "ProbeStatus",
    "ShardedDecodeError",
    "agree_on_shapes",
    "exchange_probes",
    "gather_clips",
    "make_probe",
    "order_gathered",
]

PROBE_DIMS = 8  # clip shapes of up to this many dims fit the fixed-size probe (video clips have 5)

# dtype <-> probe code (0 means "no clip"); every float dtype a decoder may emit in
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


class ShardedDecodeError(RuntimeError):
    """The group could not assemble the decoded video; raised on every rank together."""


class ProbeStatus(enum.IntEnum):
    OK = 0
    DECODER_RAISED = 1
    RAGGED_LOCAL = 2  # this rank's own clips disagree in shape or dtype
    UNSUPPORTED = 3  # a clip the probe cannot describe (too many dims, non-float dtype)

    def describe(self) -> str:
        return {
            ProbeStatus.OK: "ok",
            ProbeStatus.DECODER_RAISED: "its clip decoder raised",
            ProbeStatus.RAGGED_LOCAL: "its own clips came out in different shapes",
            ProbeStatus.UNSUPPORTED: f"its clips are not float tensors of at most {PROBE_DIMS} dims",
        }[self]


@dataclass(frozen=True)
class Probe:
    """One rank's declaration before the payload gather."""

    rank: int
    status: ProbeStatus
    count: int  # clips this rank decoded
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    latent_frames: int = 0  # the length of the latent video this rank planned (ranks must agree)

    def clip_description(self) -> str:
        return f"{self.shape} {self.dtype}"


_PROBE_LENGTH = 5 + PROBE_DIMS  # status, count, latent frames, dtype code, ndim, shape
_SHAPE_AT = 5


def make_probe(clips: Sequence[torch.Tensor], failed: bool, device: torch.device,
               latent_frames: int = 0) -> torch.Tensor:
    """Encode this rank's outcome as a fixed-size int64 tensor (same size on every rank, always)."""
    probe = torch.zeros(_PROBE_LENGTH, dtype=torch.int64)
    probe[2] = latent_frames
    status = ProbeStatus.DECODER_RAISED if failed else ProbeStatus.OK
    if not failed and clips:
        first = clips[0]
        if first.ndim > PROBE_DIMS or first.dtype not in _DTYPE_CODES:
            status = ProbeStatus.UNSUPPORTED
        elif any(c.shape != first.shape or c.dtype != first.dtype for c in clips[1:]):
            status = ProbeStatus.RAGGED_LOCAL
        else:
            probe[3] = _DTYPE_CODES[first.dtype]
            probe[4] = first.ndim
            probe[_SHAPE_AT:_SHAPE_AT + first.ndim] = torch.tensor(first.shape, dtype=torch.int64)
    probe[0] = int(status)
    probe[1] = len(clips)
    return probe.to(device)


def exchange_probes(probe: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[Probe]:
    """All-gather every rank's probe (fixed size, so this collective cannot itself go ragged)."""
    slots = [torch.empty_like(probe) for _ in range(dist.get_world_size(group))]
    dist.all_gather(slots, probe, group=group)
    probes = []
    for rank, raw in enumerate(slots):
        values = raw.cpu().tolist()
        ndim = values[4]
        probes.append(Probe(rank=rank, status=ProbeStatus(values[0]), count=values[1],
                            dtype=_CODE_DTYPES.get(values[3]), shape=tuple(values[_SHAPE_AT:_SHAPE_AT + ndim]),
                            latent_frames=values[2]))
    return probes


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def agree_on_shapes(probes: Sequence[Probe], rank: int) -> tuple[tuple[int, ...], torch.dtype]:
    """The one clip shape and dtype the whole group will gather, or raise on every rank.

    Every rank evaluates the same gathered probes, so every rank reaches the same decision.
    ``rank`` names this rank in the message.
    """
    world = len(probes)
    failed = [p for p in probes if p.status != ProbeStatus.OK]
    if failed:
        reasons = "; ".join(f"rank {p.rank}: {p.status.describe()}" for p in failed)
        raise ShardedDecodeError(f"rank {rank}: the sharded decode stops on all {world} ranks because "
                                 f"{len(failed)} rank(s) could not decode their clips ({reasons})")
    lengths: dict[int, list[int]] = {}
    for p in probes:
        lengths.setdefault(p.latent_frames, []).append(p.rank)
    if len(lengths) > 1:
        seen = "; ".join(f"{_ranks(ranks)} planned {frames} latent frames" for frames, ranks in lengths.items())
        raise ShardedDecodeError(f"rank {rank}: the {world} ranks were not given the same latent video ({seen}); "
                                 "every rank must decode the same latents")
    working = [p for p in probes if p.count > 0]
    if not working:
        raise ShardedDecodeError(f"rank {rank}: no rank of the {world}-rank group decoded a clip")
    kinds: dict[tuple[tuple[int, ...], torch.dtype | None], list[int]] = {}
    for p in working:
        kinds.setdefault((p.shape, p.dtype), []).append(p.rank)
    if len(kinds) > 1:
        groups = "; ".join(f"{_ranks(ranks)} decoded clips of {shape} {dtype}"
                           for (shape, dtype), ranks in kinds.items())
        raise ShardedDecodeError(f"rank {rank}: ragged clip extents across the {world}-rank group ({groups}); "
                                 "the clip all-gather needs one clip shape, so every rank stops here")
    shape, dtype = next(iter(kinds))
    assert dtype is not None  # an OK probe with clips always carries a known dtype code
    return shape, dtype


def gather_clips(clips: Sequence[torch.Tensor], slots: int, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """All-gather every rank's clips as one slab of ``slots`` clips each (short ranks pad with zeros).

    Returns one slab per rank, shape (slots, *shape); slab r slot s is rank r's s-th owned clip, and
    slots past a rank's own count hold zeros that are not clips.
    """
    if len(clips) > slots:
        raise ValueError(f"{len(clips)} clips do not fit a slab of {slots} slots")
    payload = torch.zeros((slots, *shape), dtype=dtype, device=device)
    for slot, clip in enumerate(clips):
        payload[slot].copy_(clip)
    gathered = [torch.empty_like(payload) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, payload, group=group)
    return gathered


def order_gathered(slabs: Sequence[torch.Tensor], plan: plan_mod.ClipPlan, world_size: int) -> list[torch.Tensor]:
    """The gathered clips in clip order, by inverting the ownership map (padding slots are never read)."""
    where: dict[int, tuple[int, int]] = {}
    for rank in range(world_size):
        for slot, clip in enumerate(plan_mod.owned_clips(plan, rank, world_size)):
            where[clip] = (rank, slot)
    missing = [c for c in range(plan.num_clips) if c not in where]
    if missing:
        raise ShardedDecodeError(f"clips {missing} of {plan.num_clips} have no owner among {world_size} ranks")
    return [slabs[rank][slot] for rank, slot in (where[c] for c in range(plan.num_clips))]
