"""Parity checks of the decode path (registered into harness.judging.checks); the judges live in harness.decode.judge.

The decode PR's matrix (latent lengths 37, 22, 12 x worlds 1, 2, 4, 8; docs/contracts.md) and the cases beyond
it: every receiving rank's video must be bitwise the stock ``vae.decode(z)`` (max|d| 0, max ULP 0, 0 mismatched,
equal SHA-256), and the spies must show which path ran. The split is the automatic one unless a
case names it: whole clips, or (clip, tile) pairs when that leaves the busiest rank less work (W > clips,
W not dividing the clips). Beyond the matrix: every W from 1 to 8, forced splits, gather-to-one, fp16
autocast and bf16, three repeated runs, a dtype change between calls, two subgroups of one world decoding
two videos, the sharded encode, faults (every rank raises within the bound, the injected cause survives, the
group works afterwards) and the plan against the library's own call sequence.

Under ``--impl decode=MODULE:CALLABLE`` every check that can call the user's ``sharded_decode`` does (inside
every rank); the rest (a world of one, the flag off, a split forced on the suite's own implementation, the
encode, the clip-plan oracle, faults inside the suite's own implementation) are declared not judged.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from fixtures import decode_models, decode_tasks
from harness.decode import judge, oracle
from harness.decode.judge import RankDecode
from harness.judging import checks, space
from harness.judging.checkid import CheckId
from harness.judging.compare import UNSTAMPED, Verdict, exact
from harness.plugins import conformance
from harness.process.dist import WorldTaskError

__all__ = ["CASES", "ENCODE_CASES", "FAULT_BOUND_S", "FAULT_RANK", "FAULT_WORLD", "INSTALLED", "DecodeCase",
           "EncodeCase", "decode_check", "fault_id", "run_fault"]

FAULT_WORLD = 8
FAULT_RANK = 3
# every rank must raise within this bound (a hung rank is one that has not answered by then): a tiny decode
# fails in well under a second, so the bound is about hangs, not speed
FAULT_BOUND_S = 20.0
ALIVE_TIMEOUT_S = 10.0
FAULT_POLICY = "fact: every rank raises within the bound, the injected cause survives, the group works afterwards"


@dataclass(frozen=True)
class DecodeCase:
    """One decode comparison: latent length, world size and what else differs from the tiny default."""

    frames: int
    world: int
    batch: int = 1
    dtype: str = "float32"
    slicing: bool = False
    shard: bool = True  # the opt-in flag
    transport: str = "all_gather"
    dst: int = 0
    split: str = "auto"
    autocast: str = ""
    groups: tuple[tuple[int, ...], ...] = ()  # subgroups of the world, each decoding its own video
    tag: str = ""  # extra id part (bf16, batch2, flag_off, ...)
    what: str = "bitexact"
    family: str = ""  # an installed VAE; the suite's own when empty
    height: int = 8  # latent pixels of a frame: 3 x 3 tiles of the tiny VAE, overlaps [4, 4] px both ways
    width: int = 8

    @property
    def check_id(self) -> str:
        tag = f".{self.tag}" if self.tag else ""
        family = f".{self.family}" if self.family else ""
        return f"decode{family}.t{self.frames}.w{self.world}{tag}.{self.what}"

    @property
    def not_judged(self) -> str | None:
        """Why no user implementation can run in this case (None: a conformance run judges it)."""
        if not self.shard:
            return "the opt-in flag is off: the stock call runs, no sharded implementation"
        if self.world == 1:
            return "a world of one takes the stock call: no sharded implementation runs"
        if self.split != "auto":
            return (f"forces the suite's own {self.split} split, an option of its implementation only (yours picks "
                    "its own split: judged where clips > ranks and where ranks > clips)")
        return None

    def job(self) -> decode_tasks.TinyDecodeJob:
        vae = decode_models.VaeSpec(dtype=self.dtype, slicing=self.slicing)
        latents = decode_models.LatentSpec(self.frames, self.height, self.width, batch=self.batch)
        return decode_tasks.TinyDecodeJob(latents, vae, self.shard,
                                          self.transport, self.dst, self.split, self.autocast, self.groups,
                                          self.family)


MATRIX = tuple(DecodeCase(frames, world) for frames in (37, 22, 12) for world in (1, 2, 4, 8))
BEYOND = (
    DecodeCase(30, 4),  # padded tail (2 repeated latent frames), 6 clips over 4 ranks
    DecodeCase(13, 3),  # padded tail (4 repeated latent frames), 3 clips over 3 ranks
    DecodeCase(9, 8),  # padded tail, 2 clips, 6 idle ranks under a clip split
    DecodeCase(22, 5),  # 4 clips over 5 ranks (tiles)
    DecodeCase(37, 6),  # 7 clips over 6 ranks (tiles)
    DecodeCase(13, 7),  # 3 clips over 7 ranks (tiles)
    DecodeCase(22, 3, batch=2, tag="batch2"),  # batch 2 in one `_decode`, 4 clips over 3 ranks
    DecodeCase(22, 2, batch=2, slicing=True, tag="batch2_sliced"),  # one sharded `_decode` per video
    DecodeCase(37, 4, dtype="bfloat16", tag="bf16"),
    DecodeCase(12, 8, dtype="bfloat16", tag="bf16"),  # bf16 with more ranks than clips
    DecodeCase(22, 2, autocast="float16", tag="fp16_autocast"),
    DecodeCase(37, 8, autocast="float16", tag="fp16_autocast"),  # tiles under autocast
    DecodeCase(22, 2, split="tiles", tag="tiles"),  # forced tile split where auto picks clips
    DecodeCase(37, 3, split="clips", what="decoded_once"),  # forced clip split: 3, 2, 2 clips
    DecodeCase(37, 4, transport="gather", dst=2, tag="gather_dst2"),  # tiles to rank 2 only
    DecodeCase(22, 2, transport="gather", tag="gather"),  # clips to rank 0 only
    DecodeCase(37, 4, shard=False, tag="flag_off", what="stock_call"),
    # the group handed in is not the world: evens and odds each decode their own video, group rank != global rank
    DecodeCase(37, 8, groups=((0, 2, 4, 6), (1, 3, 5, 7)), tag="subgroups"),
    # gather-to-one inside subgroups: group rank 1 is global rank 2 in one group and 3 in the other, so a dst passed
    # where torch.distributed wants the global rank lands outside the group or on the wrong member
    DecodeCase(22, 4, groups=((0, 2), (1, 3)), transport="gather", dst=1, tag="subgroups_gather_dst1"),
)
# every installed VAE (harness.plugins.entry_points.VAES, with a tiny model) gets the seed's matrix on its own tiny
# model
INSTALLED = tuple(replace(case, family=name) for name in decode_models.installed_vaes() for case in MATRIX)
CASES = MATRIX + BEYOND + INSTALLED


def decode_check(case: DecodeCase, ctx: checks.CheckContext) -> Verdict:
    """Run ``case`` in a world of its size and judge every group's video against its stock decode."""
    sharded = case.shard and case.world > 1
    if not case.groups:
        return judge.compare_sharded_decode(ctx.world(case.world), decode_tasks.decode_task, case.job(),
                                            sharded=sharded, timeout_s=ctx.task_timeout_s)
    results = ctx.world(case.world).run(decode_tasks.decode_task, case.job(), timeout_s=ctx.task_timeout_s)
    verdicts = []
    for index, ranks in enumerate(case.groups):
        group = sorted((r for r in results if r.group == index), key=lambda r: r.rank)
        verdict = judge.judge_decode(group, sharded=sharded, what=f"decoded video of group {index}")
        verdicts.append(verdict.with_metrics(**{f"group{index}_global_ranks": list(ranks)}))
    return functools.reduce(Verdict.merge, verdicts)


for _case in CASES:
    checks.register(_case.check_id, policy=exact())(functools.partial(decode_check, _case))
    if _case.not_judged:
        conformance.not_judged(_case.check_id, _case.not_judged)
    # where it sits in the decode input space (harness.judging.space): the VAE, the transport, slicing, the dtype
    space.at(_case.check_id, vae=_case.family or "minimax_h3", transport=_case.transport,
             slicing="on" if _case.slicing else "off", dtype=_case.dtype)
space.at("decode.*", vae="minimax_h3", transport="all_gather", slicing="off")  # repeats, a dtype switch, faults

# --------------------------------------------------------------------------------------------- repeats, dtypes


REPEATS = DecodeCase(37, 4, tag="repeat3", what="identical")
DTYPE_SWITCH = DecodeCase(22, 2, tag="dtype_switch")


@checks.register(REPEATS.check_id, policy=exact())
def repeat_runs_identical(ctx: checks.CheckContext) -> Verdict:
    """Three sharded decodes of a video, alternating with three of another video of the same geometry, on the
    same ranks: every run on every rank bitwise its stock video (so all three are identical)."""
    job = REPEATS.job()
    world = ctx.world(4)
    verdict = judge.compare_sharded_decode(world, decode_tasks.decode_task, job, sharded=True,
                                           timeout_s=ctx.task_timeout_s)
    per_rank = world.run(decode_tasks.repeat_task, job, 3, timeout_s=ctx.task_timeout_s)
    for name in ("a", "b"):
        runs = [run for rank in per_rank for run in rank[name]]
        stock = per_rank[0][f"stock_{name}"][0]
        if {tuple(r.shape) for r in runs} != {tuple(stock.shape)}:
            return verdict.merge(Verdict(UNSTAMPED, False, {"video": name}, exact().describe(), float("inf"),
                                         message=f"video {name}: a repeated run has another shape"))
        actual = torch.stack(runs)
        again = exact().judge(actual, stock.unsqueeze(0).expand_as(actual), what=f"video {name} runs")
        verdict = verdict.merge(again.with_metrics(**{f"runs_{name}": f"{len(runs)} (3 per rank)"}))
    return verdict


@checks.register(DTYPE_SWITCH.check_id, policy=exact())
def dtype_switch(ctx: checks.CheckContext) -> Verdict:
    """The same geometry decoded in float32 and then in bfloat16 on the same ranks: both bit-exact."""
    job = DTYPE_SWITCH.job()
    per_rank = ctx.world(2).run(decode_tasks.dtype_switch_task, job, timeout_s=ctx.task_timeout_s)
    verdicts = [judge.judge_decode([r[i] for r in per_rank], sharded=True) for i in range(len(per_rank[0]))]
    return functools.reduce(Verdict.merge, verdicts)


# --------------------------------------------------------------------------------------------- encode


@dataclass(frozen=True)
class EncodeCase:
    frames: int
    world: int
    transport: str = "all_gather"
    dst: int = 0
    autocast: str = ""
    tag: str = ""

    @property
    def check_id(self) -> str:
        tag = f".{self.tag}" if self.tag else ""
        return f"decode.encode.f{self.frames}.w{self.world}{tag}.bitexact"

    def job(self) -> decode_tasks.EncodeJob:
        return decode_tasks.EncodeJob(self.frames, transport=self.transport, dst=self.dst, autocast=self.autocast)


ENCODE_CASES = (
    EncodeCase(40, 2),  # 3 clips (padded) over 2 ranks
    EncodeCase(51, 4),  # 3 clips over 4 ranks: one idle
    EncodeCase(1, 2),  # a single frame: one spatial encode
    EncodeCase(40, 3, transport="gather", dst=1, tag="gather_dst1"),
    EncodeCase(40, 2, autocast="float16", tag="fp16_autocast"),
)


def _encode_check(case: EncodeCase, ctx: checks.CheckContext) -> Verdict:
    results = ctx.world(case.world).run(decode_tasks.encode_task, case.job(), timeout_s=ctx.task_timeout_s)
    return judge.judge_decode(results, sharded=True, policy=exact(), what="encoded moments")


for _encode in ENCODE_CASES:
    checks.register(_encode.check_id, policy=exact())(functools.partial(_encode_check, _encode))
conformance.not_judged("decode.encode.*", "the sharded encode is the suite's own; the decode conformance "
                                          "signature is sharded_decode")


# --------------------------------------------------------------------------------------------- oracle


ORACLE = CheckId("decode", "", "oracle", "call_sequence")


@checks.register(ORACLE, policy="fact: the plan's clip windows, tile windows and frame sources are the library's")
def plan_against_library() -> Verdict:
    """The plan's clip windows, tile windows and frame sources against the stock decode's own calls."""
    tiled = decode_models.tiny_vae()
    untiled = decode_models.tiny_vae(decode_models.VaeSpec(tiling=False))
    cases = [(tiled, decode_models.latents(decode_models.LatentSpec(frames))) for frames in (37, 13)]
    cases += [(untiled, decode_models.latents(decode_models.LatentSpec(frames, height=2, width=2)))
              for frames in (22, 9, 3)]
    return oracle.judge_plan_against_library(cases)


conformance.not_judged(str(ORACLE), "judges the suite's clip plan against the library's own "
                                                      "_decode calls; no sharded implementation runs")


# --------------------------------------------------------------------------------------------- faults


def fault_id(kind: str) -> CheckId:
    """The id of the fault check of ``kind``: ``decode.fault.w8.<kind>``."""
    return CheckId("decode", "fault", f"w{FAULT_WORLD}", kind)


def run_fault(world, job: decode_tasks.DecodeJob, kind: str, fault_rank: int,
              timeout_s: float) -> Verdict:
    """Inject ``kind`` (on ``fault_rank``, or on every rank for a group fault) and judge the behaviour: every rank
    raises within the bound and none hangs, the injected exception survives in what was raised, and the group
    still works afterwards: an all-gather over every rank completes (no rank left inside a collective or out of
    step), and the same decode without the fault is bit-exact again (so raising on every call cannot pass). A decode
    that is not bit-exact again heads the verdict with its numbers: that is the fast path's arithmetic, not its fault
    handling."""
    bound = min(timeout_s, FAULT_BOUND_S)
    outcomes, statuses, numbers = None, [], None
    try:
        outcomes = world.run(decode_tasks.fault_task, job, fault_rank, kind, timeout_s=bound)
    except WorldTaskError as err:
        statuses = err.outcomes
    group_error = "the world was torn down (a rank hung or died)"
    if world.alive:
        try:
            world.run(decode_tasks.group_alive_task, timeout_s=ALIVE_TIMEOUT_S)
            again = world.run(decode_tasks.decode_task, job, timeout_s=bound)
            group_error = follow_up_error(again)
            if group_error is not None:
                numbers = judge.judge_decode(again, sharded=True, what="the decode without the fault")
        except WorldTaskError as err:
            group_error = str(err).splitlines()[0][:240]
    verdict = judge.judge_fault(world.size, fault_rank, bound, outcomes, statuses,
                                decode_tasks.RAISING.get(kind, ""), group_error)
    return verdict if numbers is None else numbers.merge(verdict)


def follow_up_error(again: Sequence[RankDecode]) -> str | None:
    """What is wrong with the decode run again without the fault (None: every receiving rank holds the stock video,
    bit-exact, where the stock decode leaves it). A decode that differs from stock is said to be so: not bit-exact,
    or a CPU copy, is the implementation's numbers and placement, not its fault handling."""
    stock = again[0].stock_sha256
    off = [r.rank for r in again if r.output is not None and r.sha256 != stock]
    moved = [r.rank for r in again if r.output is not None and (r.moved_by or r.device != r.home)]
    if off:
        return (f"the decode without the fault is not bit-exact with the stock decode on ranks {off} (the fast path's "
                f"numbers, not its fault handling: see the decode bitexact checks)")
    if moved:
        return (f"the decode without the fault is not where the stock decode leaves its video on ranks {moved} "
                f"(another device, or a CPU copy: the fast path's placement, not its fault handling)")
    return None


def _fault_check(kind: str, ctx: checks.CheckContext) -> Verdict:
    job = decode_tasks.TinyDecodeJob(decode_models.LatentSpec(37))
    return run_fault(ctx.world(FAULT_WORLD), job, kind, FAULT_RANK, ctx.task_timeout_s)


for _kind in decode_tasks.FAULTS:
    checks.register(fault_id(_kind), policy=FAULT_POLICY,
                    doc=f"{decode_tasks.FAULT_KINDS[_kind]}: every rank raises in time, cause kept, group works")(
        functools.partial(_fault_check, _kind))
for _kind, _what in decode_tasks.SUITE_FAULTS.items():
    conformance.not_judged(str(fault_id(_kind)),
                           f"{_what}: a fault inside the suite's implementation, not at a boundary yours owns")
