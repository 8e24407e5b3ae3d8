"""The collectives of the sharded decode and encode, every one of them fail-closed.

The rule: every rank runs the same sequence of collectives whatever happens on it, and all local
work that can fail (decoding, allocating the gather buffers, the post-loop) happens BEFORE a small
fixed-size status exchange, never between a status exchange and the collective it guards. So:

1. probe: after decoding its pieces every rank all-gathers a fixed-size probe (status, count, latent
   length, dtype, shape); agreement is derived from ALL probes, so a decoder error or a ragged piece
   on one rank stops every rank together, before any payload moves;
2. gather: buffers are allocated, then ``confirm("gather")`` (one int per rank);
3. assemble: the payload collective (sized from the agreed probe so it cannot go ragged) and the
   post-loop run, then ``confirm("assemble")``: a rank that raised in or right after the payload
   collective, or in its post-loop, makes every rank raise instead of the others returning a video alone.

A failure anywhere therefore raises ShardedDecodeError on every rank within one status exchange,
naming the failed rank, with no rank left inside a collective. The status exchanges are ordinary
all-gathers of device tensors, so the same design holds on NCCL (no gloo-only monitored_barrier). What
stays the launcher's to report is a peer that stops or dies inside a collective: the suite's worlds
(harness.process.dist, and harness.process.launch under torchrun) raise on every rank within their fault bound, and a
bare training job has its process-group timeout or NCCL's async error handling.
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
    "TRANSPORTS",
    "Probe",
    "ProbeStatus",
    "ShardedDecodeError",
    "agree_on_shapes",
    "buffer_key",
    "collect",
    "confirm",
    "destination",
    "exchange_probes",
    "make_probe",
    "order_units",
    "prepare_gather",
    "read_probe",
    "receives",
]

TRANSPORTS = ("all_gather", "gather")  # every rank gets the pieces / only the destination rank does

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
    units: int = 0  # pieces the whole video splits into on this rank's plan (ranks must agree)


_PROBE_LENGTH = 6 + PROBE_DIMS  # status, count, latent frames, dtype code, ndim, units, shape
_SHAPE_AT = 6


def make_probe(clips: Sequence[torch.Tensor], failed: bool, device: torch.device,
               latent_frames: int = 0, units: int = 0) -> torch.Tensor:
    """Encode this rank's outcome as a fixed-size int64 tensor (same size on every rank, always)."""
    probe = torch.zeros(_PROBE_LENGTH, dtype=torch.int64)
    probe[2] = latent_frames
    probe[5] = units
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
    return [read_probe(rank, raw) for rank, raw in enumerate(slots)]


def read_probe(rank: int, raw: torch.Tensor) -> Probe:
    """Decode rank ``rank``'s probe tensor (the inverse of `make_probe`)."""
    values = raw.tolist()  # any device: tolist() copies to the host
    ndim = values[4]
    return Probe(rank=rank, status=ProbeStatus(values[0]), count=values[1], dtype=_CODE_DTYPES.get(values[3]),
                 shape=tuple(values[_SHAPE_AT:_SHAPE_AT + ndim]), latent_frames=values[2], units=values[5])


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
    splits: dict[int, list[int]] = {}
    for p in probes:
        splits.setdefault(p.units, []).append(p.rank)
    if len(splits) > 1:
        seen = "; ".join(f"{_ranks(ranks)} split the video into {units} pieces" for units, ranks in splits.items())
        raise ShardedDecodeError(f"rank {rank}: the {world} ranks planned different splits ({seen}); every rank "
                                 "must decode with the same VAE settings (tiling, tile size)")
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




def confirm(step: str, failure: BaseException | None, rank: int, device: torch.device,
            group: dist.ProcessGroup | None = None) -> None:
    """Status exchange after ``step``'s local work: raise ShardedDecodeError on every rank if any rank failed.

    Every rank calls this whether or not its own work failed (the failure is passed in, not raised), so
    the collective sequence never diverges; the error names every failed rank, and on a failed rank
    carries its own cause.
    """
    status = torch.tensor([0 if failure is None else 1], dtype=torch.int64, device=device)
    slots = [torch.empty_like(status) for _ in range(dist.get_world_size(group))]
    dist.all_gather(slots, status, group=group)
    failed = [r for r, s in enumerate(slots) if int(s.item())]
    if failed:
        own = f"; this rank failed: {type(failure).__name__}: {failure}" if failure is not None else ""
        raise ShardedDecodeError(f"rank {rank}: the sharded decode stops on all {len(slots)} ranks because "
                                 f"{_ranks(failed)} failed at the {step} step{own}") from failure


def destination(dst: int, world_size: int) -> int:
    """The group rank a gather-to-one lands on: the caller's ``dst``, checked against the group."""
    if not 0 <= dst < world_size:
        raise ValueError(f"dst {dst} is not a rank of the {world_size}-rank group")
    return dst


def receives(rank: int, transport: str, dst: int) -> bool:
    """Whether ``rank`` ends up holding the gathered pieces (every rank, or the destination only)."""
    return transport == "all_gather" or rank == dst


def buffer_key(world_size: int, slots: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
               receiving: bool) -> tuple[object, ...]:
    """What decides the gather buffers: a cached set is reused only for the very same key."""
    return (world_size, slots, tuple(shape), dtype, str(device), receiving)


_BUFFERS: dict[tuple[object, ...], tuple[torch.Tensor, list[torch.Tensor] | None]] = {}


def prepare_gather(pieces: Sequence[torch.Tensor], slots: int, shape: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device, world_size: int, receiving: bool
                   ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """This rank's payload slab (its pieces, zero padding after them) and its receive slabs (None when it
    receives nothing). The buffers of the last call are reused when the key matches, so repeated decodes
    of one geometry do not re-allocate; the served pieces are copied by the post-loop before a reuse."""
    if len(pieces) > slots:
        raise ValueError(f"{len(pieces)} pieces do not fit a slab of {slots} slots")
    key = buffer_key(world_size, slots, shape, dtype, device, receiving)
    cached = _BUFFERS.get(key)
    if cached is None:
        _BUFFERS.clear()  # one geometry at a time: never hold more than one video's worth
        payload = torch.empty((slots, *shape), dtype=dtype, device=device)
        received = [torch.empty_like(payload) for _ in range(world_size)] if receiving else None
        cached = _BUFFERS[key] = (payload, received)
    payload, received = cached
    payload.zero_()
    for slot, piece in enumerate(pieces):
        payload[slot].copy_(piece)
    return payload, received


def collect(payload: torch.Tensor, received: list[torch.Tensor] | None, transport: str, dst: int,
            group: dist.ProcessGroup | None = None) -> list[torch.Tensor] | None:
    """The bare payload collective: all-gather, or gather to ``dst`` (a rank of ``group``)."""
    if transport == "all_gather":
        assert received is not None
        dist.all_gather(received, payload, group=group)
        return received
    target = dst if group is None else dist.get_global_rank(group, dst)
    dist.gather(payload, received, dst=target, group=group)
    return received


def order_units(slabs: Sequence[torch.Tensor], num_units: int, world_size: int) -> list[torch.Tensor]:
    """The gathered pieces in unit order, by inverting the ownership map (padding slots are never read)."""
    where: dict[int, tuple[int, int]] = {}
    for rank in range(world_size):
        for slot, unit in enumerate(plan_mod.owned_units(num_units, rank, world_size)):
            where[unit] = (rank, slot)
    missing = [u for u in range(num_units) if u not in where]
    if missing:
        raise ShardedDecodeError(f"pieces {missing} of {num_units} have no owner among {world_size} ranks")
    return [slabs[rank][slot] for rank, slot in (where[u] for u in range(num_units))]
