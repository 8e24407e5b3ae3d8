"""Parity checks of the replay path (registered into harness.judging.checks).

Fake-kernel cases are judged bitwise (the kernel is row-wise and batch-shape invariant, so any
difference is a layout bug). Every registered replay family, the suite's own and any an installed
package registers, gets the same generated catalogue on a tiny random-init model: batched vs serial
at cfg 1 and 2 (log-probs and transition means) under the local-scale bound of
harness.replay.policies, built from the batch-shape floor measured on the stock path; determinism;
its CFG combine held to the pipeline expression its combine names; its adapter refusing a row field
of the wrong count (the harness broadcasts rows, never the adapter); and its example conditions
telling rows and CFG branches apart (harness.replay.discriminating). Every fast-path check also
proves the fast path ran: one transformer forward of S*cfg*B rows.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from fakes.replay_conditions import HI3_FIELDS, SD3_FIELDS, labelled_conditions, read_labels
from fixtures.replay_cases import (
    BATCH,
    UNSORTED_TARGET,
    fake_problem,
    middle_varying_schedule,
    real_control,
    real_problem,
)
from fixtures.replay_families import QUANTITIES, family_names
from fixtures.replay_models import tiny_model
from harness.judging import floors, space
from harness.judging.checks import register
from harness.judging.compare import Verdict, exact, holds, raises
from harness.plugins import conformance
from harness.replay import denoiser, discriminating, pipeline_oracle, tiling
from harness.replay.conditions import Conditions, broadcast_rows, payload_rows, slice_rows
from harness.replay.denoiser import WrappedAdapter, concat_branches, predict_velocity
from harness.replay.families import get_family
from harness.replay.families.base import ModelAdapter
from harness.replay.guards import ReplayConfig
from harness.replay.judge import (
    compare_replay,
    compare_replay_determinism,
    judge_result,
    require_fast_path,
    run_batched,
    run_both,
    run_serial,
)
from harness.replay.policies import RESOLUTION_ULPS, LocalScaleBound, local_scale_policy
from harness.replay.problem import ReplayProblem
from harness.replay.replay import replay
from harness.replay.sde import MultistepSDE
from harness.replay.segment import ReplayResult
from harness.replay.spy import spy_forwards

FAKE_CASES = ("cfg1", "cfg2", "uncond_first")
FAMILIES = family_names()  # every registered replay family: shipped or installed
REAL_CASES = tuple((family, cfg, what) for family in FAMILIES for cfg in (1, 2) for what in QUANTITIES)
TILE_REPEATS = 4


FAST_PATH_POLICY = "fact: the batched replay ran (one forward of S*cfg*B rows) and returned [B, S] results"
GUARD_POLICY = "fact: the guard declines (None) and no forward runs"
TILING_POLICY = "fact: the tiled conditions are laid out as the CFG layout requires (rows counted and labelled)"


def _register(check_id: str, fn, *args, doc: str, policy=None) -> None:
    register(check_id, doc=doc, policy=policy)(functools.partial(fn, *args))


# ------------------------------------------------------------------------- fake kernel: batched vs serial


def returns_result(case: str) -> Verdict:
    problem = fake_problem(case)
    result, forwards = run_batched(problem)
    ok = isinstance(result, ReplayResult) and result.target == problem.target
    verdict = holds(ok, "batched replay returns a ReplayResult for the requested targets",
                     returned=type(result).__name__)
    return require_fast_path(verdict, problem, forwards)


def log_probs_shape(case: str) -> Verdict:
    problem = fake_problem(case)
    result, forwards = run_batched(problem)
    want = [problem.segment.batch, problem.steps]
    got = None if result is None else list(result.log_probs.shape)
    means = None if result is None else list(result.prev_sample_means.shape)
    ok = got == want and means == [*want, *problem.segment.latent_shape]
    verdict = holds(ok, f"log_probs is [B, S] = {want} and prev_sample_means [B, S, *latent]",
                     log_probs_shape=str(got), means_shape=str(means))
    return require_fast_path(verdict, problem, forwards)


def batched_equals_serial(case: str, what: str) -> Verdict:
    return compare_replay(fake_problem(case), exact(), what)


def forward_count(case: str) -> Verdict:
    problem = fake_problem(case)
    run = run_both(problem)
    verdict = holds(run.batched is not None, "batched replay ran (flag on, stateless SDE, S > 1)")
    return require_fast_path(verdict, problem, run.batched_forwards, run.serial_forwards)


def replay_determinism(case: str) -> Verdict:
    return compare_replay_determinism(fake_problem(case))


for _case in FAKE_CASES:
    _register(f"replay.{_case}.returns_result", returns_result, _case, policy=FAST_PATH_POLICY,
              doc="batched replay returns a ReplayResult (one forward of S*cfg*B rows)")
    _register(f"replay.{_case}.log_probs_shape", log_probs_shape, _case, policy=FAST_PATH_POLICY,
              doc="batched log_probs are [B, S]")
    _register(f"replay.{_case}.log_probs", batched_equals_serial, _case, "log_probs", policy=exact(),
              doc="batched log_probs == serial, bitwise, every row and step")
    _register(f"replay.{_case}.prev_sample_means", batched_equals_serial, _case, "prev_sample_means", policy=exact(),
              doc="batched transition means == serial, bitwise")
    _register(f"replay.{_case}.forward_count", forward_count, _case, policy=FAST_PATH_POLICY,
              doc="batched: one forward of S*cfg*B rows; serial: S forwards of cfg*B")
    _register(f"replay.{_case}.replay_determinism", replay_determinism, _case, policy=exact(),
              doc="the batched replay run twice: exp(logp_2 - logp_1) == 1 and the means bitwise equal")


@register("replay.cfg2.unsorted_targets", policy=exact())
def unsorted_targets() -> Verdict:
    """An unsorted proper subset of sde_indices replays bitwise like serial (column s is target[s])."""
    problem = fake_problem("cfg2").with_(target=UNSORTED_TARGET)
    verdict = compare_replay(problem, exact(), "log_probs")
    return verdict.merge(compare_replay(problem, exact(), "prev_sample_means"))


@register("replay.cfg2.last_step_targeted", policy=exact())
def last_step_targeted() -> Verdict:
    """The schedule's final step (sigma_next = 0) sampled and replayed beside earlier steps: an off-by-one there
    shows as that step's column, not as error growth."""
    problem = fake_problem("last_step")
    verdict = compare_replay(problem, exact(), "log_probs")
    return verdict.merge(compare_replay(problem, exact(), "prev_sample_means"))


@register("replay.cfg2.list_payloads", policy=exact())
def list_payloads() -> Verdict:
    """Conditions carried only by list/tuple payloads (per-branch and branch-independent) tile like tensors."""
    problem = fake_problem("list_payloads")
    verdict = compare_replay(problem, exact(), "log_probs")
    return verdict.merge(compare_replay(problem, exact(), "prev_sample_means"))


@register("replay.cfg2.step_varying_guidance", policy=exact())
def step_varying_guidance_falls_back() -> Verdict:
    """A per-step guidance schedule that varies over the targets: replay() must give serial's answer
    through the serial loop (S forwards)."""
    problem = fake_problem("step_varying_guidance")
    expected, _ = run_serial(problem)
    with spy_forwards(problem.adapter.module) as spy:
        result = replay(problem.adapter, problem.conditions, problem.segment, problem.strategy, problem.target,
                        problem.guidance, problem.config)
    verdict = judge_result(exact(), result.log_probs, expected.log_probs, problem.target, "log_probs")
    want = [problem.serial_rows] * problem.steps
    return verdict.require(spy.batch_sizes == want, f"the serial loop ran: {problem.steps} forwards of "
                           f"{problem.serial_rows} rows", forwards=spy.batch_sizes)


# ------------------------------------------------------------------------------------------------- guards


def _declines(problem: ReplayProblem, fact: str) -> Verdict:
    result, forwards = run_batched(problem)
    return holds(result is None and not forwards, fact, returned=type(result).__name__,
                  forwards=str(list(forwards)))


@register("replay.guard.flag_off", policy=GUARD_POLICY)
def guard_flag_off() -> Verdict:
    """The default config (batch_replay_steps off) keeps the serial loop."""
    problem = fake_problem("cfg2").with_(config=ReplayConfig())
    return _declines(problem, "flag off -> None, no forward")


@register("replay.guard.single_step", policy=GUARD_POLICY)
def guard_single_step() -> Verdict:
    """S == 1 gains nothing from batching: None."""
    problem = fake_problem("cfg2").with_(target=(3,))
    return _declines(problem, "S == 1 -> None, no forward")


@register("replay.guard.stateful_solver", policy=GUARD_POLICY)
def guard_stateful_solver() -> Verdict:
    """A stateful multistep solver (step_index, history) is not a stateless SDE: None."""
    problem = fake_problem("cfg2").with_(strategy=MultistepSDE())
    return _declines(problem, "stateful solver -> None, no forward")


@register("replay.guard.step_varying_guidance", policy=GUARD_POLICY)
def guard_step_varying_guidance() -> Verdict:
    """Guidance that varies across target steps cannot fold into one forward: None."""
    return _declines(fake_problem("step_varying_guidance"),
                     "step-varying guidance -> None, no forward")


def guard_middle_varying_guidance(family: str | None) -> Verdict:
    """A schedule whose first and last targets share a scale and a middle target does not: a guard that compares
    only the ends batches it with the wrong scale at that step."""
    problem = fake_problem("cfg2") if family is None else real_problem(family, 2)
    schedule = middle_varying_schedule(tuple(problem.target), steps=problem.segment.sigmas.numel() - 1)
    return _declines(problem.with_(guidance=schedule), "guidance varying at a middle target only -> None, no forward")


_register("replay.guard.middle_varying_guidance", guard_middle_varying_guidance, None, policy=GUARD_POLICY,
          doc="a schedule that varies only at a middle target declines: None, no forward")
for _family in FAMILIES:
    _register(f"replay.{_family}.guard.middle_varying_guidance", guard_middle_varying_guidance, _family,
              policy=GUARD_POLICY, doc=f"{_family}: a schedule that varies only at a middle target declines")


# ------------------------------------------------------------------------------------------------- tiling


def _fused() -> Conditions:
    return labelled_conditions(BATCH, HI3_FIELDS, "fused")


def _expected_labels(conditions: Conditions, name: str, repeats: int) -> list[int]:
    """Branch-major outside, step-major inside; a B-row field is used once per branch."""
    value = conditions.rows[name]
    labels = read_labels(value)
    batch = conditions.batch
    if conditions.cfg_factor == 2:
        branches = [labels[:batch], labels[batch:]] if payload_rows(value) == 2 * batch else [labels, labels]
    else:
        branches = [labels]
    return [label for branch in branches for label in branch * repeats]


@register("replay.tiling.batch_size", policy=TILING_POLICY)
def tiling_batch_size() -> Verdict:
    """Every tiled row field has S*cfg*B rows, and the batched forward sees S*cfg*B rows."""
    conditions = _fused()
    tiled = tiling.tile_conditions(conditions, TILE_REPEATS)
    want = TILE_REPEATS * 2 * BATCH
    sizes = {name: payload_rows(value) for name, value in tiled.rows.items()}
    verdict = holds(all(n == want for n in sizes.values()) and tiled.forward_rows == want,
                     f"every field of the tiled fused batch has S*cfg*B = {want} rows", **sizes)
    problem = fake_problem("cfg2")
    _, forwards = run_batched(problem)
    return require_fast_path(verdict, problem, forwards)


@register("replay.tiling.branch_major", policy=TILING_POLICY)
def tiling_branch_major() -> Verdict:
    """Fused cond-first: [cond_s0..cond_s(S-1), uncond_s0..]; uncond-first: block repetition per branch."""
    bad = {}
    fused = _fused()
    tiled = tiling.tile_conditions(fused, TILE_REPEATS)
    for name in fused.rows:
        got, want = read_labels(tiled.rows[name]), _expected_labels(fused, name, TILE_REPEATS)
        if got != want:
            bad[f"fused.{name}"] = f"{got[:2 * BATCH]}... expected {want[:2 * BATCH]}..."
    sd3 = labelled_conditions(BATCH, SD3_FIELDS, "uncond_first")
    tiled_sd3 = tiling.tile_conditions(sd3, TILE_REPEATS)
    for branch, source, out in (("cond", sd3, tiled_sd3), ("uncond", sd3.negative, tiled_sd3.negative)):
        for name in source.rows:
            got, want = read_labels(out.rows[name]), _expected_labels(source, name, TILE_REPEATS)
            if got != want:
                bad[f"uncond_first.{branch}.{name}"] = f"{got[:2 * BATCH]}... expected {want[:2 * BATCH]}..."
    return holds(not bad,
                  "tiled rows are branch-major with step-major inside (every field, both layouts)", **bad)


@register("replay.tiling.repeats_identity", policy=TILING_POLICY)
def tiling_repeats_identity() -> Verdict:
    """repeats == 1 returns the conditions themselves (no copy, nothing re-laid-out), in both layouts."""
    fused, sd3 = _fused(), labelled_conditions(BATCH, SD3_FIELDS, "uncond_first")
    same = {"fused": tiling.tile_conditions(fused, 1) is fused, "uncond_first": tiling.tile_conditions(sd3, 1) is sd3}
    return holds(all(same.values()), "tile_conditions(c, 1) is c", **same)


@register("replay.tiling.rope_cache", policy=TILING_POLICY)
def tiling_rope_cache() -> Verdict:
    """The per-sample rope_cache [N, 2, L, D] is tiled like any row field, not passed through verbatim."""
    fused = _fused()
    tiled = tiling.tile_conditions(fused, TILE_REPEATS)
    rope = tiled.rows["rope_cache"]
    got, want = read_labels(rope), _expected_labels(fused, "rope_cache", TILE_REPEATS)
    ok = rope is not fused.rows["rope_cache"] and tuple(rope.shape[1:]) == tuple(fused.rows["rope_cache"].shape[1:])
    return holds(ok and got == want,
                  f"rope_cache tiled to {len(want)} rows, branch-major", rows=len(got), layout=str(got[:2 * BATCH]))


@register("replay.tiling.fused_uncond_cleared", policy=TILING_POLICY)
def tiling_fused_uncond_cleared() -> Verdict:
    """fused_uncond caches the untiled uncond rows; tiling clears it (shared fields pass through)."""
    fused = _fused()
    tiled = tiling.tile_conditions(fused, TILE_REPEATS)
    ok = fused.fused_uncond is not None and tiled.fused_uncond is None
    shared_kept = all(tiled.shared[k] is v for k, v in fused.shared.items())
    return holds(ok and shared_kept,
                  "fused_uncond is None after tiling and shared fields pass through",
                  fused_uncond_after=str(None if tiled.fused_uncond is None else sorted(tiled.fused_uncond)),
                  shared_kept=shared_kept)


@register("replay.tiling.repeats_zero", policy=TILING_POLICY)
def tiling_repeats_zero() -> Verdict:
    """repeats = 0 is a ValueError naming repeats (not a silently empty batch)."""
    return raises(lambda: tiling.tile_conditions(_fused(), 0), ValueError,
                         match="repeats must be >= 1")


@register("replay.tiling.repeats_negative", policy=TILING_POLICY)
def tiling_repeats_negative() -> Verdict:
    """repeats = -1 is a ValueError naming repeats."""
    return raises(lambda: tiling.tile_conditions(_fused(), -1), ValueError,
                         match="repeats must be >= 1")


# ----------------------------------------------------------------------------- tiny diffusers models (fp32)


def real_policy(family: str, cfg: int, what: str) -> LocalScaleBound:
    """fp32 local-scale bound from the stock batch-shape control (harness.replay.policies)."""
    return local_scale_policy(real_control(family, cfg), what, torch.float32)


def _with_floor(verdict: Verdict, policy: LocalScaleBound) -> Verdict:
    """Print the measured stock floor beside the bound (and fail on a floor that is not a number)."""
    return verdict.require(math.isfinite(policy.relative_floor),
                           f"stock batch-shape floor measured: {policy.relative_floor:.2e} of the local magnitude",
                           measured_floor=policy.relative_floor, bound=policy.relative_bound)


def real_batched_vs_serial(family: str, cfg: int, what: str) -> Verdict:
    policy = real_policy(family, cfg, what)
    return _with_floor(compare_replay(real_problem(family, cfg), policy, what), policy)


for _family, _cfg, _what in REAL_CASES:
    _register(f"replay.{_family}.cfg{_cfg}.{_what}", real_batched_vs_serial, _family, _cfg, _what, policy=real_policy,
              doc=f"tiny {_family} cfg={_cfg}: batched {_what} within the local-scale bound of the stock floor")


def real_determinism(family: str) -> Verdict:
    return compare_replay_determinism(real_problem(family, 2))


for _family in FAMILIES:
    _register(f"replay.{_family}.cfg2.replay_determinism", real_determinism, _family, policy=exact(),
              doc=f"tiny {_family} cfg=2: the batched replay run twice gives ratio exactly 1")


# ------------------------------------------------------------------------ the family's CFG combine


class _RecordedBranches(WrappedAdapter):
    """The family's adapter whose one forward returns the branch outputs its pipeline's transformer gave, laid out
    in the adapter's rows: ``predict_velocity`` then applies the family's own split, combine and velocity."""

    def __init__(self, inner: ModelAdapter, rows: torch.Tensor):
        super().__init__(inner)
        self.rows = rows
        self.calls: list[int] = []

    def forward(self, hidden: torch.Tensor, timestep: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        self.calls.append(int(hidden.shape[0]))
        return self.rows


def pipeline_combine(family: str) -> Verdict:
    """predict_velocity, given the branch outputs the family's own diffusers pipeline computed, hands the
    scheduler what that pipeline handed it (its combine and any post-processing), at every recorded step."""
    from parity.replay_pipeline_checks import oracle_record

    adapter, record = oracle_record(family)
    conditions = adapter.conditions_from_prompts(record.prompts, 2)
    order = pipeline_oracle.adapter_order(denoiser.declared_layout(adapter), conditions.batch)
    verdicts = []
    for i, step in enumerate(record.steps):
        aligned = pipeline_oracle.align_family(get_family(family), step, record.prompts, order)
        recorded = _RecordedBranches(adapter, pipeline_oracle.to_replay(adapter, aligned.output))
        x = adapter.from_pipeline_latents(step.latents)
        got = predict_velocity(recorded, x, step.sigma.expand(conditions.batch), conditions, record.guidance)
        expected = adapter.from_pipeline_latents(step.model_output)
        declared = denoiser.declared_combine(adapter)
        verdict = pipeline_oracle.judge_combine(f"step {i} velocity from the pipeline's branch outputs", got, expected,
                                                f"the family's combine ({declared}) and "
                                                f"{adapter.velocity_transform} velocity vs {family}'s pipeline",
                                                declared=declared)
        verdicts.append(verdict.require(recorded.calls == [2 * conditions.batch],
                                        f"step {i}: one forward of both CFG branches ({2 * conditions.batch} rows)",
                                        forwards=recorded.calls))
    return functools.reduce(Verdict.merge, verdicts).with_metrics(declared_combine=denoiser.declared_combine(adapter))


for _family in FAMILIES:
    _register(f"replay.{_family}.cfg2.pipeline_combine", pipeline_combine, _family,
              policy=pipeline_oracle.COMBINE_POLICY,
              doc=f"tiny {_family}: the family's CFG combine and velocity transform are its diffusers pipeline's")


ROW_COUNT_POLICY = "fact: a ValueError before the transformer runs (no silent repeat)"


def adapter_refuses_rows(family: str) -> Verdict:
    """An adapter handed a row field with fewer rows than its forward refuses it with a ValueError before its
    transformer runs (it never repeats rows). Judged by behaviour, not wording: the exception's type, and the
    transformer's forward spy empty."""
    problem = real_problem(family, 2)
    conditions = problem.conditions
    fused = concat_branches(conditions.negative, conditions) if conditions.negative is not None else conditions
    full = broadcast_rows(fused)
    name = sorted(full.rows)[0]
    short = Conditions(batch=full.batch, rows={**full.rows, name: full.rows[name][:BATCH]}, shared=full.shared,
                       cfg_factor=full.cfg_factor)
    x = problem.segment.latent_at(problem.target[0]).float()
    timestep = problem.adapter.timestep(torch.full((2 * BATCH,), 0.6))
    raised: Exception | None = None
    with spy_forwards(problem.adapter.module) as spy:
        try:
            problem.adapter.forward(torch.cat([x, x]), timestep, short)
        except Exception as err:  # noqa: BLE001 - which exception, if any, is the verdict
            raised = err
    return holds(isinstance(raised, ValueError) and spy.calls == 0,
                 f"a row field {name!r} of {BATCH} rows in a forward of {2 * BATCH} is refused with a ValueError "
                 "before the transformer runs", raised="nothing" if raised is None else type(raised).__name__,
                 forwards=str(spy.batch_sizes))


for _family in FAMILIES:
    _register(f"replay.{_family}.row_count_refused", adapter_refuses_rows, _family, policy=ROW_COUNT_POLICY,
              doc=f"the {_family} adapter refuses a row field of the wrong row count (no silent repeat)")


# ------------------------------------------------------------------ discriminating example conditions


def _fresh_conditions(family: str) -> Conditions:
    """The family's cfg-2 example conditions drawn now (not cached), refused unless they discriminate."""
    registered = get_family(family)
    adapter = registered.adapter(tiny_model(family))
    return registered.example_conditions(adapter, BATCH, 2, torch.Generator().manual_seed(22))


def _with_row(value, index: int, row):
    """``value`` with row ``index`` replaced by ``row`` (a tensor or list/tuple payload)."""
    if isinstance(value, torch.Tensor):
        out = value.clone()
        out[index] = row
        return out
    items = list(value)
    items[index] = row
    return type(value)(items)


def _repeated(conditions: Conditions, name: str, across: bool) -> Conditions:
    """``conditions`` with one row of field ``name`` copied onto another: within the cond branch, or
    (``across``) from the cond branch onto the uncond branch's same sample."""
    batch = conditions.batch
    if conditions.negative is not None:
        source = conditions.rows[name]
        if not across:
            return dataclasses.replace(conditions, rows={**conditions.rows, name: _with_row(source, 1, source[0])})
        neg = conditions.negative
        return dataclasses.replace(conditions, negative=dataclasses.replace(
            neg, rows={**neg.rows, name: _with_row(neg.rows[name], 0, source[0])}))
    value = conditions.rows[name]
    target = batch if across else 1
    return dataclasses.replace(conditions, rows={**conditions.rows, name: _with_row(value, target,
                                                                                     slice_rows(value, 0, 1)[0])})


def conditions_discriminate(family: str) -> Verdict:
    """The family's example conditions pass the discriminating check, and each row field with one row copied
    onto another (within a branch; across branches for a field each branch carries) is refused, naming it."""
    conditions = _fresh_conditions(family)
    refused, missed = [], []
    for name, value in sorted(conditions.rows.items()):
        per_branch = conditions.negative is not None or payload_rows(value) == 2 * conditions.batch
        for across in (False, True) if per_branch else (False,):
            found = discriminating.problems(_repeated(conditions, name, across))
            (refused if any(f"row field {name!r}" in text for text in found) else missed).append(
                f"{name} ({'across branches' if across else 'within a branch'})")
    return holds(bool(refused) and not missed,
                  "every row field made to repeat a row (within a branch, and across branches) is refused by name",
                  refused=", ".join(refused), missed=", ".join(missed))


for _family in FAMILIES:
    _register(f"replay.{_family}.conditions_discriminate", conditions_discriminate, _family,
              policy="fact: every row field made to repeat a row is refused by name",
              doc=f"the {_family} example conditions tell rows and CFG branches apart; a repeated row is refused")


# Under --impl replay=MODULE:CALLABLE every other replay check calls the user's replay_batched; these cannot.
for _pattern, _reason in {
    "replay.cfg2.step_varying_guidance": "judges the suite's replay() dispatcher, whose own guard sends a varying "
                                         "schedule to the serial loop (your replay_batched's decline is judged by "
                                         "replay.guard.step_varying_guidance)",
    **{f"replay.tiling.{name}": "judges the suite's tile_conditions seam directly; no batched replay runs"
       for name in ("branch_major", "repeats_identity", "rope_cache", "fused_uncond_cleared", "repeats_zero",
                    "repeats_negative")},
    "replay.*.cfg2.pipeline_combine": "judges the family's CFG combine against its pipeline's; no batched replay runs",
    "replay.*.row_count_refused": "judges the family adapter's refusal of a short row field; no batched replay runs",
    "replay.*.conditions_discriminate": "judges the family's example conditions (rows and CFG branches told apart); "
                                        "no batched replay runs",
    "replay.oracle.*": "judges the SDE step, CFG combine or rollout stock and fast share against an independent "
                       "oracle; no batched replay runs",
}.items():
    conformance.not_judged(_pattern, _reason)

_REPLAY_FLOOR = (f"{RESOLUTION_ULPS:g} fp32 ulps of the local magnitude (the SDE math's resolution)",
                 "8 sqrt(K) ulps of the model's dtype, K = the denoiser's Linear/Conv fan-ins plus the latent's "
                 "elements (the batch-shape control is stock code at the fast path's shape)")
for _pattern in ("replay.*.log_probs", "replay.*.prev_sample_means", "replay.*.growth*"):
    floors.declare(_pattern, *_REPLAY_FLOOR)
floors.declare("replay.*.cfg2.pipeline_combine", "4 fp32 ulps of the local magnitude",
               "8 ulps (K = 1: the same elementwise combine on the pipeline's own branch outputs, no model runs)")

# Where each check sits in the replay input space (harness.judging.space): the family it drives, its CFG layout,
# combine and factor, and whether guidance arrives as one scale or a per-step schedule. The fake problems replay
# under a schedule (constant over the targets, different everywhere else); a family's tiny model under one scale.
space.at("replay.*", guidance="schedule", cfg="2")
for _pattern, _layout in (("replay.cfg1.*", "fused_cond_first"), ("replay.cfg2.*", "fused_cond_first"),
                          ("replay.uncond_first.*", "uncond_first"), ("replay.guard.*", "fused_cond_first"),
                          ("replay.tiling.*", "fused_cond_first")):
    space.at(_pattern, family="fake", cfg_layout=_layout, combine="standard", payload="tensor")
space.at("replay.cfg1.*", cfg="1")
space.at("replay.cfg2.list_payloads", payload="list")
for _family in FAMILIES:
    _adapter_class = get_family(_family).adapter_class
    _combine = _adapter_class.cfg_combine
    space.at(f"replay.{_family}.*", family=_family, cfg_layout=_adapter_class.cfg_layout,
             combine=getattr(_combine, "name", "") or str(_combine), guidance="scale")
    space.at(f"replay.{_family}.cfg1.*", cfg="1")
    space.at(f"replay.{_family}.growth.*", cfg="1")
    space.at(f"replay.{_family}.guard.*", guidance="schedule")
