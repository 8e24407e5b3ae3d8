"""Judges of the decode path: what every rank returned against the stock call, plus the spies of the path.

The parity checks (parity/decode_checks.py) and the gpu tier (gpu/decode.py) both judge here, so a
real checkpoint over NCCL is held to exactly the CPU tier's rules: every receiving rank's video is
bitwise the stock ``vae.decode(z)`` (dtype and shape included, equal SHA-256), ranks that receive
nothing return None, and the counts prove which path ran (each piece decoded exactly once across
the world and the fail-closed collective sequence on the sharded path; every decoder call on every
rank and no collective on the stock one). A bad frame is named with the clip(s) it comes from and the
rank(s) that decoded them, as measured (decoder inputs fingerprinted), so the message holds for any plan.

Faults are judged by behaviour, not by wording (``judge_fault``): every rank raises within the bound and
none hangs, the injected exception survives in the raised error's cause/context chain, and the group
still works afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.decode import exchange
from harness.decode import plan as plan_mod
from harness.judging.compare import UNSTAMPED, Policy, Verdict, exact, holds

__all__ = ["FaultOutcome", "RankDecode", "busiest_shares", "compare_sharded_decode", "expected_collectives",
           "frame_labels", "judge_decode", "judge_fault", "piece_calls", "producers"]


@dataclass
class RankDecode:
    """One rank's answer: its output (None where it receives nothing), its hash, and what the spies saw."""

    rank: int
    world_size: int
    output: torch.Tensor | None
    sha256: str | None
    decoder_calls: int  # real decoder forwards (tile decodes) on this rank during the call under test
    clip_calls: int  # real `_decode_clip` (or `_encode_clip`) calls on this rank
    pieces: int  # pieces of one call (clips of an encode)
    dst: int  # the group rank a ``transport="gather"`` lands on
    group: int  # which subgroup of the world this rank decoded in (its ``rank`` is its rank there)
    collectives: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    work: plan_mod.WorkPlan | None = None  # the work plan of one `_decode` call (None for encode)
    calls: int = 1  # `_decode`/`_encode` calls the library's wrapper makes (one per video when it slices)
    transport: str = "all_gather"
    impl_calls: int | None = None  # calls of a user's implementation under test (conformance mode)
    stock: torch.Tensor | None = None  # rank 0's stock output, same process, when asked for
    stock_sha256: str | None = None
    received_bytes: int = 0  # bytes of gathered pieces this rank received (memory it held for them)
    decoded: tuple[str, ...] = ()  # fingerprints of this rank's decoder inputs during the call under test
    stock_decoded: tuple[str, ...] = ()  # rank 0: fingerprints of the stock decode's decoder inputs, in call order
    device: str = ""  # where the call left its output, before the task moved it here ("" without one)
    home: str = ""  # this rank's latents' device: where the stock decode returns its video
    stock_device: str = ""  # rank 0: where the stock decode returned it
    moved_by: str = ""  # the call that moved the returned output to the CPU ("Tensor.cpu()"); "" for none


@dataclass(frozen=True)
class FaultOutcome:
    """What one rank's call did under an injected fault (harness-side, so judging needs no test code)."""

    rank: int
    raised: str  # "Type: message" of what the call raised; "" when it returned
    seconds: float  # from the call to its raise (or return)
    fired: int  # how often the fault struck on this rank (0: it never did)
    root_cause_kept: bool | None  # the injected exception is in the raised one's chain; None: none injected here


def frame_labels(plan: plan_mod.ClipPlan, num_frames: int, made_by: dict[int, list[int]] | None = None) -> list[str]:
    """Name each output pixel frame by the clip(s) it came from and, with ``made_by`` (clip -> ranks that decoded
    a piece of it), the rank(s) that produced them, for failure messages."""
    def clip(c: int) -> str:
        if made_by is None:
            return str(c)
        ranks = made_by.get(c)
        return f"{c} on rank {'+'.join(map(str, ranks))}" if ranks else f"{c} (its planned input decoded on no rank)"

    return [f"{frame} (clip {'/'.join(clip(c) for c in src)}{' cross-fade' if len(src) > 1 else ''})"
            for frame, src in enumerate(plan_mod.frame_sources(plan, num_frames))]


def producers(results: Sequence[RankDecode]) -> dict[int, list[int]] | None:
    """clip -> the ranks whose decoder decoded one of its planned pieces, matched by input fingerprint against
    the stock decode's own calls (clip-major, as the library makes them); None without fingerprints."""
    first = results[0]
    if not first.stock_decoded or first.work is None:
        return None
    per_clip = first.work.tiles_per_clip
    clip_of: dict[str, int] = {}
    for index, printed in enumerate(first.stock_decoded):
        clip_of.setdefault(printed, (index // per_clip) % first.work.clips.num_clips)
    made_by: dict[int, set[int]] = {}
    for r in results:
        for printed in r.decoded:
            if printed in clip_of:
                made_by.setdefault(clip_of[printed], set()).add(r.rank)
    return {c: sorted(ranks) for c, ranks in sorted(made_by.items())}


def piece_calls(work: plan_mod.WorkPlan, rank: int, world: int) -> int:
    """The decoder calls rank ``rank`` makes for its pieces of one sharded `_decode` on ``work``."""
    owned = len(plan_mod.owned_units(work.num_units, rank, world))
    return owned * work.tiles_per_clip if work.split == "clips" else owned


def busiest_shares(work: plan_mod.WorkPlan, world: int) -> float:
    """The busiest rank's share of the decoder work of one call."""
    return max(piece_calls(work, r, world) for r in range(world)) / work.decoder_calls


def expected_collectives(transport: str, calls: int) -> dict[str, int]:
    """The fail-closed sequence per call: probe, gather status, payload, assemble status."""
    if transport == "all_gather":
        return {"all_gather": 4 * calls}
    return {"all_gather": 3 * calls, "gather": calls}


def _with_summary(verdict: Verdict) -> Verdict:
    """Headline the four numbers the decode PR reported per case (docs/contracts.md): max|d|, max ULP,
    mismatched / total, rank hashes."""
    m = verdict.metrics
    summary = (f"max|d| {m.get('max_abs', '-')}, max ULP {m.get('max_ulp', '-')}, "
               f"mismatched {m.get('mismatched', '-')}/{m.get('total', '-')} over {m['receivers']} ranks, "
               f"rank SHA-256 {m['ranks_matching_stock_sha']} = stock {str(m['stock_sha256'])[:12]}")
    return dataclasses.replace(verdict, headline="parity", metrics={**m, "parity": summary})


def judge_decode(results: Sequence[RankDecode], *, sharded: bool,
                 policy: Policy | None = None, what: str = "decoded video") -> Verdict:
    """Every receiving rank's output against rank 0's stock output, plus the spies of the path that must have run.

    Works for decode (``work`` set) and encode (``work`` None: the pieces are `_encode_clip` calls).
    """
    policy = policy or exact()
    first = results[0]
    stock, work, calls = first.stock, first.work, first.calls
    if stock is None:
        raise ValueError("rank 0 returned no stock reference (run the task with with_stock=True)")
    world = len(results)
    transport, dst = first.transport, first.dst
    receivers = [r for r in results if not sharded or exchange.receives(r.rank, transport, dst)]
    stock_sha = first.stock_sha256
    hashes = [r.sha256 for r in receivers]
    metrics: dict[str, Any] = {
        "world": world,
        "receivers": len(receivers),
        "transport": transport if sharded else "stock",
        "pieces": first.pieces,
        "stock_sha256": stock_sha,
        "rank_sha256": [r.sha256 for r in results],
        "ranks_matching_stock_sha": f"{sum(h == stock_sha for h in hashes)}/{len(receivers)}",
        "decoder_calls_per_rank": ", ".join(str(r.decoder_calls) for r in results),
    }
    impl = [r.impl_calls for r in results]
    foreign = any(c is not None for c in impl)  # a user's implementation: its own ownership and collectives
    if work is not None:
        metrics["clips"] = work.clips.num_clips
        if foreign:  # the suite's plan says nothing of the user's: report what was measured instead
            del metrics["pieces"]
            metrics["decoder_calls_total"] = sum(r.decoder_calls for r in results)
        else:
            metrics.update(split=work.split, tiles_per_clip=work.tiles_per_clip,
                           busiest_share=round(busiest_shares(work, world), 4) if sharded else 1.0)
    made_by = producers(results) if sharded else None
    if made_by is not None:
        metrics["clip_producers"] = "; ".join(f"clip {c}: rank {'/'.join(map(str, ranks))}"
                                              for c, ranks in made_by.items())
    outputs = [r.output for r in receivers]
    shapes = sorted({tuple(o.shape) if o is not None else () for o in outputs})
    if shapes != [tuple(stock.shape)]:
        verdict = Verdict(UNSTAMPED, False, {**metrics, "shapes": shapes}, policy.describe(), float("inf"),
                          message=f"{what} shapes {shapes} differ from the stock {tuple(stock.shape)}")
    else:
        actual = torch.stack([o for o in outputs if o is not None])
        expected = stock.unsqueeze(0).expand_as(actual)
        labels = {"frame": frame_labels(work.clips, stock.shape[2], made_by)} if work is not None else None
        verdict = policy.judge(actual, expected, dims=("rank", "batch", "channel", "frame"),
                               labels=labels, what=what)
        verdict = dataclasses.replace(verdict, metrics={**verdict.metrics, **metrics})
    verdict = verdict.require(bool(hashes) and all(h == stock_sha for h in hashes),
                              "every receiving rank's SHA-256 equals the stock output's")
    verdict = _require_placement(verdict, receivers, stock, first.stock_device)
    decoder = [r.decoder_calls for r in results]
    seen = [{k: v for k, v in r.collectives.items() if v} for r in results]
    if sharded and foreign:
        total = (work.decoder_calls if work is not None else first.pieces) * calls
        counted = decoder if work is not None else [r.clip_calls for r in results]
        verdict = verdict.require_ran(sum(counted) == total, "each piece decoded exactly once across the world",
                                      pieces_per_rank=", ".join(map(str, counted)), pieces_total=total)
        verdict = verdict.require_ran(all(seen), "every rank communicated (a collective ran on every rank)",
                                      collectives_per_rank="; ".join(str(s or "none") for s in seen))
        holders = [r.rank for r in results if r.output is not None]
        verdict = verdict.require(holders == [r.rank for r in receivers],
                                  f"only the receiving ranks hold the output ({transport}); the others return None",
                                  ranks_holding_output=holders)
    elif sharded:
        holders = [r.rank for r in results if r.output is not None]
        verdict = verdict.require(holders == [r.rank for r in receivers],
                                  "only the receiving ranks hold the output; the others return None",
                                  ranks_holding_output=holders)
        if work is not None:
            owned = [piece_calls(work, r, world) * calls for r in range(world)]
            verdict = verdict.require(decoder == owned and sum(decoder) == work.decoder_calls * calls,
                                      "each piece decoded exactly once across the world (round-robin ownership)",
                                      expected_decoder_calls_per_rank=", ".join(map(str, owned)))
        else:
            owned = [len(plan_mod.owned_units(first.pieces, r, world)) * calls for r in range(world)]
            clip = [r.clip_calls for r in results]
            verdict = verdict.require(clip == owned, "each clip encoded exactly once across the world",
                                      encode_clip_calls_per_rank=", ".join(map(str, clip)))
        wanted = expected_collectives(transport, calls)
        verdict = verdict.require(seen == [wanted] * world,
                                  "every rank ran the fail-closed sharded sequence (probe, gather status, payload, "
                                  "assemble status) per call",
                                  collectives_per_rank="; ".join(str(s or "none") for s in seen))
    else:
        total = (work.decoder_calls if work is not None else first.pieces) * calls
        counted = decoder if work is not None else [r.clip_calls for r in results]
        verdict = verdict.require(counted == [total] * world and not any(seen),
                                  "the stock call was taken: every rank decoded every piece, no collective ran",
                                  collectives_per_rank="; ".join(str(s or "none") for s in seen))
    if foreign:
        verdict = verdict.require(all(c for c in impl), "the implementation under test ran on every rank",
                                  impl_calls_per_rank=impl)
    return _with_summary(verdict)


PLACED = "every receiving rank's output is on the device and in the dtype the stock call returns"
NOT_MOVED = "no receiving rank's output was moved to the CPU by the call (.cpu(), .to('cpu'))"


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _require_placement(verdict: Verdict, receivers: Sequence[RankDecode], stock: torch.Tensor,
                       stock_device: str) -> Verdict:
    """Facts the bytes cannot show: each output stays where the stock call leaves it (on its rank's latents'
    device, in the stock dtype), and the call did not hand back a CPU copy, which the CPU tier cannot tell from the
    video by its device (every rank's device is the CPU there by construction)."""
    held = [(r, r.output) for r in receivers if r.output is not None]
    wrong = [f"rank {r.rank}: {r.device or '?'} {_dtype_name(out)} (its latents on {r.home or '?'})" for r, out in held
             if r.device != r.home or out.dtype != stock.dtype]
    verdict = verdict.require(not wrong, PLACED, **({"placement": "; ".join(wrong),
                                                     "stock_placement": f"{stock_device} {_dtype_name(stock)}"}
                                                    if wrong else {}))
    moved = [f"rank {r.rank}: {r.moved_by}" for r, _ in held if r.moved_by]
    return verdict.require(not moved, NOT_MOVED, **({"moved_to_cpu": "; ".join(moved)} if moved else {}))


def compare_sharded_decode(world: Any, task: Callable[..., Sequence[RankDecode]], job: Any, *,
                           sharded: bool, policy: Policy | None = None, timeout_s: float) -> Verdict:
    """Run ``task(job)`` on every rank of ``world`` and judge it (the gpu tier calls this with a real model); every
    caller bounds the task with its own ``timeout_s`` (the run's task timeout)."""
    results = world.run(task, job, timeout_s=timeout_s)
    return judge_decode(results, sharded=sharded, policy=policy)


GROUP_WORKS = ("the group works afterwards (an all-gather over every rank, then the same decode without the fault, "
               "bit-exact)")


def judge_fault(size: int, fault_rank: int, bound_s: float, outcomes: Sequence[FaultOutcome] | None,
                world_outcomes: Sequence[Any] = (), keeps_cause: str = "", group_error: str | None = None) -> Verdict:
    """Judge a fault by behaviour: every rank raised within ``bound_s`` and none hung or returned; the fault struck
    where it was injected; the injected exception survives in the chain of what rank ``fault_rank`` raised
    (``keeps_cause="fault rank"``) or every rank raised (``"every rank"``); the group works afterwards
    (``group_error`` None: an all-gather completes and the decode without the fault is bit-exact again).
    ``outcomes`` is every rank's FaultOutcome, or None when the task itself did not come back from every rank
    (``world_outcomes``: the world's per-rank statuses, hung ranks among them)."""
    if outcomes is None:
        stuck = {s: [o.rank for o in world_outcomes if o.status == s]
                 for s in ("stuck", "hung", "blocked", "died", "raised")}
        words = "; ".join(f"{s} on ranks {ranks}" for s, ranks in stuck.items() if ranks) or "no answer"
        verdict = holds(False, f"every rank raises within {bound_s:g} s; no rank hangs or returns",
                        outcome=words, rank_outcomes=[o.line()[:240] for o in world_outcomes])
        return verdict.require(group_error is None, GROUP_WORKS, follow_up=group_error or "the group answered")
    raised = [o for o in outcomes if o.raised]
    returned = [o.rank for o in outcomes if not o.raised]
    slow = [o.rank for o in raised if o.seconds > bound_s]
    slowest = max((o.seconds for o in outcomes), default=0.0)
    words = f"{len(raised)}/{size} ranks raise" + (f"; ranks {returned} returned" if returned else "") + \
        (f"; ranks {slow} past {bound_s:g} s" if slow else "")
    verdict = holds(not returned and not slow and len(outcomes) == size,
                    f"every rank raises within {bound_s:g} s; no rank hangs or returns", outcome=words,
                    slowest_raise_s=round(slowest, 3),
                    rank_outcomes=[f"rank {o.rank}: {o.raised or 'returned'}"[:240] for o in outcomes])
    struck = [o.rank for o in outcomes if o.fired]
    where = [fault_rank] if keeps_cause != "every rank" else list(range(size))
    verdict = verdict.require(all(r in struck for r in where), f"the fault struck on rank(s) {where}",
                              fault_struck_on=struck)
    if keeps_cause:
        lost = [o.rank for o in outcomes if o.rank in where and o.raised and o.root_cause_kept is not True]
        who = "every rank" if keeps_cause == "every rank" else f"rank {fault_rank}"
        verdict = verdict.require(not lost, f"the injected exception survives in the __cause__/__context__ chain of "
                                            f"what {who} raised", root_cause_lost_on=lost)
    return verdict.require(group_error is None, GROUP_WORKS, follow_up=group_error or "the group decodes again")
