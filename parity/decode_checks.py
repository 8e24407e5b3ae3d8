"""Parity checks of the decode path (registered into harness.checks).

Seed 003's matrix (latent lengths 37, 22, 12 x worlds 1, 2, 4, 8) and the cases beyond it: every
rank's video must be bitwise the stock ``vae.decode(z)`` (max|d| 0, max ULP 0, 0 mismatched, equal
SHA-256 on every rank), and the spies must show which path ran: the sharded one decodes each clip
exactly once across the world and all-gathers; the stock one (flag off, or W == 1) decodes every
clip on every rank and runs no collective. Fault injection at W = 8 on rank 3 must make all 8 ranks
raise together, with no rank left blocked in a collective.

``compare_sharded_decode`` takes any job with ``build_vae``/``build_latents``/``shard`` (see
fixtures.decode_tasks.DecodeJob), so the GPU tier can call it with a real checkpoint over NCCL.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fixtures import decode_models, decode_tasks
from harness import checks
from harness.compare import Policy, Verdict, exact, expect
from harness.decode import plan as plan_mod
from harness.dist import World, WorldTaskError

__all__ = ["CASES", "FAULT_RANK", "FAULT_WORLD", "DecodeCase", "compare_sharded_decode", "frame_sources",
           "judge_decode", "judge_fault"]

FAULT_WORLD = 8
FAULT_RANK = 3


@dataclass(frozen=True)
class DecodeCase:
    """One decode comparison: latent length, world size and what else differs from the tiny default."""

    frames: int
    world: int
    batch: int = 1
    dtype: str = "float32"
    slicing: bool = False
    shard: bool = True  # the opt-in flag
    tag: str = ""  # extra id part (bf16, batch2, flag_off, ...)
    what: str = "bitexact"

    @property
    def check_id(self) -> str:
        tag = f".{self.tag}" if self.tag else ""
        return f"decode.t{self.frames}.w{self.world}{tag}.{self.what}"

    def job(self) -> decode_tasks.TinyDecodeJob:
        vae = decode_models.VaeSpec(dtype=self.dtype, slicing=self.slicing)
        return decode_tasks.TinyDecodeJob(decode_models.LatentSpec(self.frames, batch=self.batch), vae, self.shard)


MATRIX = tuple(DecodeCase(frames, world) for frames in (37, 22, 12) for world in (1, 2, 4, 8))
BEYOND = (
    DecodeCase(30, 4),  # padded tail (2 repeated latent frames), 6 clips over 4 ranks
    DecodeCase(13, 3),  # padded tail (4 repeated latent frames), 3 clips over 3 ranks
    DecodeCase(9, 8),  # padded tail, 2 clips, 6 idle ranks
    DecodeCase(22, 3, batch=2, tag="batch2"),  # batch 2 in one `_decode`, 4 clips over 3 ranks
    DecodeCase(22, 2, batch=2, slicing=True, tag="batch2_sliced"),  # one sharded `_decode` per video
    DecodeCase(37, 4, dtype="bfloat16", tag="bf16"),
    DecodeCase(12, 8, dtype="bfloat16", tag="bf16"),  # bf16 with idle ranks
    DecodeCase(37, 3, what="decoded_once"),  # 7 clips over 3 ranks: 3, 2, 2
    DecodeCase(37, 4, shard=False, tag="flag_off", what="stock_call"),
)
CASES = MATRIX + BEYOND


def frame_sources(plan: plan_mod.ClipPlan, num_frames: int) -> list[str]:
    """Name each output pixel frame by the clip(s) it came from, for failure messages."""
    per_clip = plan.tokens_chunk_size * plan.temporal_ratio - plan.frame_pre_padding
    labels = []
    for frame in range(num_frames):
        clip, offset = divmod(frame, per_clip)
        if clip >= plan.num_clips:
            labels.append(f"{frame} (clip {plan.num_clips - 1} tail)")
        elif clip > 0 and offset < plan.frame_overlap:
            labels.append(f"{frame} (clips {clip - 1}/{clip} cross-fade)")
        else:
            labels.append(f"{frame} (clip {clip})")
    return labels


def judge_decode(check_id: str, results: Sequence[decode_tasks.RankDecode], *, sharded: bool,
                 policy: Policy | None = None) -> Verdict:
    """Every rank's video against rank 0's stock decode, plus the spies of the path that must have run."""
    policy = policy or exact()
    stock, plan, decode_calls = results[0].stock, results[0].plan, results[0].decode_calls
    if stock is None or plan is None:
        raise ValueError(f"{check_id}: rank 0 returned no stock reference (run decode_task with with_stock=True)")
    world = len(results)
    hashes = [r.sha256 for r in results]
    stock_sha = results[0].stock_sha256
    metrics = {
        "world": world,
        "clips": plan.num_clips,
        "stock_sha256": stock_sha,
        "rank_sha256": hashes,
        "ranks_matching_stock_sha": f"{sum(h == stock_sha for h in hashes)}/{world}",
        "clip_calls_per_rank": ", ".join(str(r.clip_calls) for r in results),
    }
    shapes = {tuple(r.output.shape) for r in results}
    if shapes != {tuple(stock.shape)}:
        verdict = Verdict(check_id, False, {**metrics, "shapes": sorted(shapes)}, policy.describe(), float("inf"),
                          message=f"video shapes {sorted(shapes)} differ from the stock {tuple(stock.shape)}")
    else:
        actual = torch.stack([r.output for r in results])
        expected = stock.unsqueeze(0).expand_as(actual)
        labels = {"frame": frame_sources(plan, stock.shape[2])}
        verdict = policy.judge(check_id, actual, expected, dims=("rank", "batch", "channel", "frame"),
                               labels=labels, what="decoded video")
        verdict = dataclasses.replace(verdict, metrics={**verdict.metrics, **metrics})
    verdict = verdict.require(all(h == stock_sha for h in hashes),
                              "every rank's SHA-256 equals the stock output's")
    calls = [r.clip_calls for r in results]
    gathers = [r.collectives.get("all_gather", 0) for r in results]
    if sharded:
        owned = [len(plan_mod.owned_clips(plan, rank, world)) * decode_calls for rank in range(world)]
        verdict = verdict.require(calls == owned and sum(calls) == plan.num_clips * decode_calls,
                                  "each clip decoded exactly once across the world (rank r decodes clips r, r+W, ...)",
                                  expected_clip_calls_per_rank=", ".join(map(str, owned)))
        verdict = verdict.require(gathers == [2 * decode_calls] * world,
                                  "every rank took the sharded path: one probe and one clip all-gather per _decode",
                                  all_gathers_per_rank=", ".join(map(str, gathers)))
    else:
        verdict = verdict.require(calls == [plan.num_clips * decode_calls] * world
                                  and all(not r.collectives for r in results),
                                  "the stock call was taken: every rank decoded every clip, no collective ran",
                                  collectives_per_rank="; ".join(str(r.collectives or "none") for r in results))
    return _with_summary(verdict)


def _with_summary(verdict: Verdict) -> Verdict:
    """Headline the four numbers seed 003 reports per case: max|d|, max ULP, mismatched / total, rank hashes."""
    m = verdict.metrics
    summary = (f"max|d| {m.get('max_abs', '-')}, max ULP {m.get('max_ulp', '-')}, "
               f"mismatched {m.get('mismatched', '-')}/{m.get('total', '-')} over {m['world']} ranks, "
               f"rank SHA-256 {m['ranks_matching_stock_sha']} = stock {str(m['stock_sha256'])[:12]}")
    return dataclasses.replace(verdict, headline="parity", metrics={**m, "parity": summary})


def compare_sharded_decode(world: World, job: decode_tasks.DecodeJob, check_id: str, *,
                           policy: Policy | None = None, timeout_s: float = 120.0) -> Verdict:
    """Run ``job`` on every rank of ``world`` and judge it (the GPU tier calls this with a real model)."""
    results = world.run(decode_tasks.decode_task, job, timeout_s=timeout_s)
    return judge_decode(check_id, results, sharded=job.shard and world.size > 1, policy=policy)


def _decode_check(case: DecodeCase, ctx: checks.CheckContext) -> Verdict:
    return compare_sharded_decode(ctx.world(case.world), case.job(), case.check_id, timeout_s=ctx.task_timeout_s)


for _case in CASES:
    checks.register(_case.check_id)(functools.partial(_decode_check, _case))


# --------------------------------------------------------------------------------------------- faults


def judge_fault(check_id: str, world: World, job: decode_tasks.DecodeJob, kind: str, fault_rank: int,
                timeout_s: float) -> Verdict:
    """Inject ``kind`` on ``fault_rank``: every rank must raise ShardedDecodeError, none may block or hang,
    and the group must still decode afterwards (no rank left inside a collective)."""
    try:
        world.run(decode_tasks.fault_task, job, fault_rank, kind, timeout_s=timeout_s)
        outcomes = []
        statuses = ["ok"] * world.size
    except WorldTaskError as err:
        outcomes = err.outcomes
        statuses = [o.status for o in outcomes]
    size = world.size
    raised = [o for o in outcomes if o.status == "raised"]
    together = [o for o in raised if "ShardedDecodeError" in o.error]
    stuck = {s: statuses.count(s) for s in ("blocked", "hung", "died") if s in statuses}
    named = all(f"rank {fault_rank}" in o.error for o in together)
    cause_here = any(o.rank == fault_rank and decode_tasks.FAULT_KINDS[kind] in o.error for o in together)
    ok = len(together) == size and not stuck
    words = f"{len(raised)}/{size} ranks raise; " + ("no hang" if not stuck else
                                                     ", ".join(f"{n} {s}" for s, n in stuck.items()))
    verdict = expect(check_id, ok, f"{size}/{size} ranks raise; no hang", outcome=words,
                     sharded_decode_errors=f"{len(together)}/{size}",
                     rank_outcomes=[o.line()[:240] for o in outcomes] or ["every rank returned a video"])
    verdict = verdict.require(named and cause_here,
                              f"every rank's error names rank {fault_rank}, and rank {fault_rank}'s names the fault")
    survived = world.alive
    follow_up = "world torn down"
    if survived:
        results = world.run(decode_tasks.decode_task, job, timeout_s=timeout_s)
        hashes = {r.sha256 for r in results} | {results[0].stock_sha256}
        survived = len(hashes) == 1
        follow_up = "bit-exact on every rank" if survived else f"{len(hashes)} distinct hashes"
    return verdict.require(survived, "the group decodes again afterwards: no rank was left in a collective",
                           follow_up=follow_up)


def _fault_check(kind: str, ctx: checks.CheckContext) -> Verdict:
    job = decode_tasks.TinyDecodeJob(decode_models.LatentSpec(37))
    return judge_fault(f"decode.fault.w{FAULT_WORLD}.{kind}", ctx.world(FAULT_WORLD), job, kind, FAULT_RANK,
                       ctx.task_timeout_s)


for _kind in decode_tasks.FAULTS:
    checks.register(f"decode.fault.w{FAULT_WORLD}.{_kind}")(functools.partial(_fault_check, _kind))
