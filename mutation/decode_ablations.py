"""Ablations of the decode path: known bugs re-introduced over its seams.

The first five are the bugs named in issue 5 (seed 003's failure modes); the last two prove the spies
have teeth: a sharded decode that silently decodes everything on every rank, and a gate that ignores
the opt-in flag and the W == 1 fallback, both produce bit-exact videos and are caught only by the
clip-call and collective counts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from harness.ablation import ablation
from harness.decode import plan as plan_mod
from harness.decode.exchange import Probe, ProbeStatus, ShardedDecodeError
from harness.decode.serve import bound
from harness.dist import WorldTaskError

# ------------------------------------------------------------------ gathered clips left in rank-major order


def _rank_major(slabs: Sequence[torch.Tensor], plan: plan_mod.ClipPlan, world_size: int) -> list[torch.Tensor]:
    """Rank 0's clips, then rank 1's, ...: right only while every rank owns at most one clip."""
    return [slabs[rank][slot] for rank in range(world_size)
            for slot in range(len(plan_mod.owned_clips(plan, rank, world_size)))]


ablation(
    name="decode.rank_major_order",
    seam="harness.decode.exchange:order_gathered",
    replacement=_rank_major,
    kills=["decode.t37.w2.bitexact", "decode.t37.w4.bitexact", "decode.t22.w2.bitexact",
           "decode.t30.w4.bitexact", "decode.t22.w3.batch2.bitexact", "decode.t37.w4.bf16.bitexact",
           "decode.t37.w3.decoded_once"],
    why="round-robin ownership interleaves clips across ranks; concatenating the gathered slabs rank by rank "
        "puts clip r+W right after clip r wherever a rank owns two or more clips",
    kill_mode="tolerance",
)

# ------------------------------------------------------------------ an idle rank's zero slab taken as a clip


def _every_slot(slabs: Sequence[torch.Tensor], plan: plan_mod.ClipPlan, world_size: int) -> list[torch.Tensor]:
    """Every gathered slot in round-robin order, the zero padding of short and idle ranks included."""
    return [slab[slot] for slot in range(slabs[0].shape[0]) for slab in slabs]


ablation(
    name="decode.idle_zero_slab_taken",
    seam="harness.decode.exchange:order_gathered",
    replacement=_every_slot,
    kills=["decode.t37.w8.bitexact", "decode.t22.w8.bitexact", "decode.t12.w4.bitexact",
           "decode.t12.w8.bitexact", "decode.t9.w8.bitexact", "decode.t37.w2.bitexact",
           "decode.t12.w8.bf16.bitexact"],
    why="a rank with no clip (W > clips), or fewer than the slab holds, sends zeros so the all-gather sizes "
        "match; taking those zeros as clips hands the post-loop more clips than the plan has, which the clip "
        "server refuses on every rank (ShardedDecodeError -> WorldTaskError, all ranks raised)",
    raises=(WorldTaskError,),
    kill_mode="raises",
)

# ------------------------------------------------------------------ one cross-fade skipped


def _skip_first_crossfade(original: Callable[[Any, torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    def run_post_loop(vae: Any, z: torch.Tensor) -> torch.Tensor:
        blend = vae._blend
        calls = [0]

        def blend_all_but_first(a: torch.Tensor, b: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
            calls[0] += 1
            return b if calls[0] == 1 else blend(a, b, extent, dim)

        with bound(vae, "_blend", blend_all_but_first):
            return original(vae, z)

    return run_post_loop


ablation(
    name="decode.crossfade_skipped",
    seam="harness.decode.serve:run_post_loop",
    replacement=_skip_first_crossfade,
    wraps=True,
    kills=["decode.gpu.bitexact", "decode.t37.w2.bitexact", "decode.t37.w8.bitexact", "decode.t22.w4.bitexact",
           "decode.t12.w2.bitexact", "decode.t12.w8.bitexact", "decode.t30.w4.bitexact",
           "decode.t37.w4.bf16.bitexact"],
    why="clips 0 and 1 overlap by frame_overlap pixel frames; taking clip 1's frames unblended changes "
        "exactly those frames, a post-loop that is not the library's",
    kill_mode="tolerance",
)

# ------------------------------------------------------------------ shape agreement from the local clip only


def _local_shape_only(probes: Sequence[Probe], rank: int) -> tuple[tuple[int, ...], torch.dtype]:
    """Trust this rank's own clip (an idle rank borrows the first working rank's): nobody else's failure
    or extent is seen, so a faulty rank stops alone and the others enter the payload gather without it."""
    mine = probes[rank]
    if mine.status != ProbeStatus.OK:
        raise ShardedDecodeError(f"rank {rank}: {mine.status.describe()}")
    source = mine if mine.count else next(p for p in probes if p.count)
    assert source.dtype is not None
    return source.shape, source.dtype


ablation(
    name="decode.shape_agreement_local",
    seam="harness.decode.exchange:agree_on_shapes",
    replacement=_local_shape_only,
    kills=["decode.fault.w8.decoder_raises", "decode.fault.w8.ragged_clip"],
    why="seed 003's first iteration: agreement from the local clip only leaves 7 ranks blocked in the clip "
        "all-gather when rank 3's decoder raises (they are reported blocked after the grace period), and a "
        "ragged clip makes gloo abort the mismatched gather; either way not '8/8 ranks raise; no hang'",
    hang_timeout_s=10.0,
    kill_mode="fact",
    fact="8/8 ranks raise",
)

# ------------------------------------------------------------------ only rank 0's clips used


def _rank0_slab_for_all(clips: Sequence[torch.Tensor], slots: int, shape: tuple[int, ...], dtype: torch.dtype,
                        device: torch.device, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Broadcast instead of all-gather: every rank ends up with rank 0's slab in every rank's place."""
    payload = torch.zeros((slots, *shape), dtype=dtype, device=device)
    for slot, clip in enumerate(clips):
        payload[slot].copy_(clip)
    dist.broadcast(payload, src=0, group=group)
    return [payload] * dist.get_world_size(group)


ablation(
    name="decode.rank0_clips_only",
    seam="harness.decode.exchange:gather_clips",
    replacement=_rank0_slab_for_all,
    kills=[f"decode.t{t}.w{w}.bitexact" for t in (37, 22, 12) for w in (2, 4, 8)]
    + ["decode.gpu.bitexact", "decode.t30.w4.bitexact", "decode.t13.w3.bitexact", "decode.t9.w8.bitexact",
       "decode.t22.w3.batch2.bitexact", "decode.t22.w2.batch2_sliced.bitexact", "decode.t37.w4.bf16.bitexact",
       "decode.t12.w8.bf16.bitexact", "decode.t37.w3.decoded_once"],
    why="every clip owned by rank r > 0 is replaced by one of rank 0's clips, so all but rank 0's frames are "
        "wrong on every rank while the shapes, the call counts and the collective count still look right",
    kill_mode="tolerance",
)

# ------------------------------------------------------------------ every rank decodes every clip (spy teeth)


def _all_clips(plan: plan_mod.ClipPlan, rank: int, world_size: int) -> tuple[int, ...]:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size} ranks")
    return tuple(range(plan.num_clips))


ablation(
    name="decode.every_rank_decodes_all",
    seam="harness.decode.plan:owned_clips",
    replacement=_all_clips,
    kills=[f"decode.t{t}.w{w}.bitexact" for t in (37, 22, 12) for w in (2, 4, 8)]
    + ["decode.t37.w3.decoded_once", "decode.t30.w4.bitexact", "decode.t22.w2.batch2_sliced.bitexact"],
    why="seed 003's waste itself: every rank decodes the whole video; the gathered video is still bit-exact, "
        "so only the per-rank clip-call spy (each clip exactly once across the world) can catch it",
    kill_mode="fact",
    fact="each clip decoded exactly once across the world",
)

# ------------------------------------------------------------------ the gate ignores the flag and W == 1


def _always_shard(enabled: bool, group: dist.ProcessGroup | None = None) -> bool:
    return dist.is_available() and dist.is_initialized()


ablation(
    name="decode.gate_ignores_flag",
    seam="harness.decode.sharded:takes_sharded_path",
    replacement=_always_shard,
    kills=["decode.t37.w1.bitexact", "decode.t22.w1.bitexact", "decode.t12.w1.bitexact",
           "decode.t37.w4.flag_off.stock_call"],
    why="the flag defaults to off and W == 1 must take the stock call unchanged; a gate that shards whenever a "
        "group exists is bit-exact too, so only the collective and clip-call spies can tell",
    kill_mode="fact",
    fact="the stock call was taken: every rank decoded eve",
)
