"""Batched replays written the way a team's own framework would, for ``--impl replay=zoo_replay:NAME``.

Signature: ``replay_batched(adapter, conditions, segment, strategy, target, guidance=None, config=None)``
returning a ``harness.replay.segment.ReplayResult`` (log_probs [B, S] with column s for target[s],
prev_sample_means [B, S, ...]), or None when it declines (the flag is off, one step, a stateful solver, or
guidance that varies over the targets: the caller then replays serially). ``guidance`` is a float or a
per-step schedule. The building blocks are the suite's public ones a trainer shares with its rollout
(``predict_velocity`` runs the adapter's one forward and the family's CFG combine, ``sde_step`` the SDE
transition); the stacking, the condition tiling and the guards are this module's own.

``replay_batched`` is right: conditions tiled branch-major (``[cond x S, uncond x S]``, so a fused model's
midpoint split keeps the branches apart), the guidance of the targets' own step. Every other callable
carries one realistic bug (see ``BUGS``); each must fail the replay checks it names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from harness.replay.conditions import Conditions, concat_payloads, payload_rows, slice_rows
from harness.replay.denoiser import DenoiserAdapter, predict_velocity
from harness.replay.sde import sde_step
from harness.replay.segment import ReplayResult

__all__ = ["BUGS", "CORRECT", "batches_without_a_config", "guidance_at_step_zero", "log_probs_not_transposed",
           "nesting_swapped", "never_declines", "next_latents_rounded_to_bf16", "one_sigma_for_every_step",
           "replay_batched", "targets_sorted", "velocity_transform_dropped"]


@dataclass(frozen=True)
class Flaws:
    """Which bug the replay carries (all False: the right one).

    The fields no ``BUGS`` entry sets re-create publicly reported bugs (``corpus/replay.py``)."""

    step_major: bool = False  # conditions tiled [cond, uncond] x S: the midpoint split mixes branches
    guidance_step0: bool = False  # the scale read at step 0, not at the targets
    no_transpose: bool = False  # [S*B] log-probs reshaped straight to [B, S]
    sorted_targets: bool = False  # targets replayed (and returned) in sorted order
    no_guards: bool = False  # batches whatever it is given
    first_sigma: bool = False  # every row stepped with the first target's sigma
    pooled_branches_swapped: bool = False  # the pooled fields' CFG branches in the other order than every other field
    pooled_rows_interleaved: bool = False  # pooled fields copied row by row (r0 r0 r1 r1), the others block by block
    guidance_embed_x1000: bool = False  # the embedded guidance scaled by 1000 before a model that scales it itself
    timestep_x1000: bool = False  # sigma scaled to 0-1000 before a timestep hook that scales it again
    sigma_rounded_bf16: bool = False  # sigma rounded to bf16 before the timestep hook (rollout kept it fp32)
    missing_config_on: bool = False  # no config given read as the switch on
    own_wrapper: bool = False  # the adapter behind a wrapper of its own that forwards every hook but ``velocity``
    next_latents_bf16: bool = False  # x_(t+1) cast to bf16 by hard-coding, not kept in the trajectory's dtype


def _scale(guidance: Any, step: int) -> float:
    if isinstance(guidance, (int, float)) and not isinstance(guidance, bool):
        return float(guidance)
    if not 0 <= step < len(guidance):
        raise ValueError(f"guidance schedule has {len(guidance)} entries; no scale for step {step}")
    return float(guidance[step])


def _declines(config: Any, strategy: Any, steps: Sequence[int], guidance: Any, flaws: Flaws) -> bool:
    """The cases the batched path must leave to the serial loop (with ``missing_config_on``, only a config that
    turns the flag off declines: none at all batches)."""
    switched_off = config is not None and not config.batch_replay_steps
    if not flaws.missing_config_on:
        switched_off = switched_off or config is None
    return (switched_off or len(steps) <= 1
            or not getattr(strategy, "stateless", False) or len({_scale(guidance, s) for s in steps}) > 1)


def _targets(segment: Any, target: Sequence[int]) -> tuple[int, ...]:
    if isinstance(target, (str, bytes)) or not isinstance(target, Sequence):
        raise TypeError(f"target must be a sequence of step indices, got {type(target).__name__}")
    steps = tuple(target)
    if not steps or any(isinstance(s, bool) or not isinstance(s, int) for s in steps):
        raise ValueError(f"target must hold int step indices, got {list(steps)}")
    if len(set(steps)) != len(steps):
        raise ValueError(f"target steps {list(steps)} appear more than once")
    unknown = [s for s in steps if s not in segment.sde_indices]
    if unknown:
        raise ValueError(f"target steps {unknown} are not SDE steps of this segment")
    return steps


def _copies(group: Any, repeats: int, interleaved: bool) -> list[Any]:
    """``repeats`` copies of one branch group: whole blocks (the right order), or each row repeated in place."""
    if interleaved and isinstance(group, torch.Tensor):
        return [group.repeat_interleave(repeats, dim=0)]
    return [group] * repeats


def _tiled(conditions: Conditions, repeats: int, flaws: Flaws) -> Conditions:
    """Every row field to cfg x S x B rows: branch groups outside, the S copies inside (or backwards)."""
    batch, branches = conditions.batch, conditions.cfg_factor
    rows = {}
    for name, value in conditions.rows.items():
        per_branch = payload_rows(value) == batch * branches
        groups = [slice_rows(value, b * batch, (b + 1) * batch) if per_branch else value for b in range(branches)]
        interleaved = "pooled" in name and flaws.pooled_rows_interleaved
        ordered = ([g for _ in range(repeats) for g in groups] if flaws.step_major
                   else [c for g in groups for c in _copies(g, repeats, interleaved)])
        rows[name] = concat_payloads(ordered)
    negative = None if conditions.negative is None else _tiled(conditions.negative, repeats, flaws)
    return dataclasses.replace(conditions, batch=batch * repeats, rows=rows, negative=negative, fused_uncond=None)


def _pooled_swapped(conditions: Conditions) -> Conditions:
    """The pooled fields' two CFG branches exchanged, every other field left in place: fused rows swap halves,
    uncond-first conditions swap their pooled fields with the negative's."""
    pooled = [name for name in conditions.rows if "pooled" in name]
    if conditions.negative is not None:
        rows = {**conditions.rows, **{n: conditions.negative.rows[n] for n in pooled}}
        negative = {**conditions.negative.rows, **{n: conditions.rows[n] for n in pooled}}
        return dataclasses.replace(conditions, rows=rows,
                                   negative=dataclasses.replace(conditions.negative, rows=negative))
    if conditions.cfg_factor != 2:
        return conditions
    half = conditions.batch
    rows = dict(conditions.rows)
    for name in pooled:
        if payload_rows(rows[name]) == 2 * half:
            rows[name] = concat_payloads([slice_rows(rows[name], half, 2 * half), slice_rows(rows[name], 0, half)])
    return dataclasses.replace(conditions, rows=rows)


def _scaled_guidance(conditions: Conditions) -> Conditions:
    """The shared embedded-guidance field times 1000 (on the negative branch too)."""
    shared = dict(conditions.shared)
    if "guidance" in shared:
        shared["guidance"] = shared["guidance"] * 1000.0
    negative = None if conditions.negative is None else _scaled_guidance(conditions.negative)
    return dataclasses.replace(conditions, shared=shared, negative=negative)


class _StackedBatch(DenoiserAdapter):
    """The team's own wrapper around the family's adapter for the stacked batch: it hands on the layout, the
    combine, the timestep hook and the forward, but not ``velocity``, so the base class's (the prediction itself)
    answers for the family's transform."""

    def __init__(self, inner: DenoiserAdapter):
        self.inner, self.module = inner, inner.module
        self.cfg_layout, self.cfg_combine, self.channel_dim = inner.cfg_layout, inner.cfg_combine, inner.channel_dim

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        return self.inner.timestep(sigma)

    def forward(self, hidden: torch.Tensor, timestep: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        return self.inner.forward(hidden, timestep, conditions)

    def combine(self, cond: torch.Tensor, uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        return self.inner.combine(cond, uncond, guidance_scale)


def _replay(adapter: Any, conditions: Conditions, segment: Any, strategy: Any, target: Sequence[int],
            guidance: Any, config: Any, flaws: Flaws) -> ReplayResult | None:
    steps = _targets(segment, target)
    conditions.validate()
    if conditions.batch != segment.batch:
        raise ValueError(f"conditions hold {conditions.batch} rows but the segment {segment.batch} samples")
    if not flaws.no_guards and _declines(config, strategy, steps, guidance, flaws):
        return None
    if flaws.sorted_targets:
        steps = tuple(sorted(steps))
    count, batch = len(steps), segment.batch
    x = torch.cat([segment.latent_at(s) for s in steps]).float()
    prev = torch.cat([segment.latent_at(s + 1) for s in steps])
    if flaws.next_latents_bf16:
        prev = prev.to(torch.bfloat16)
    at = torch.tensor(steps).repeat_interleave(batch)
    if flaws.first_sigma:
        at = torch.full_like(at, steps[0])
    sigma, sigma_next = segment.sigmas[at], segment.sigmas[at + 1]
    scale = _scale(guidance, 0 if flaws.guidance_step0 else steps[0])
    tiled = conditions if count == 1 else _tiled(conditions, count, flaws)
    if flaws.pooled_branches_swapped:
        tiled = _pooled_swapped(tiled)
    if flaws.guidance_embed_x1000:
        tiled = _scaled_guidance(tiled)
    model_sigma = sigma * 1000.0 if flaws.timestep_x1000 else sigma
    if flaws.sigma_rounded_bf16:
        model_sigma = model_sigma.to(torch.bfloat16).to(sigma.dtype)
    model = _StackedBatch(adapter) if flaws.own_wrapper else adapter
    velocity = predict_velocity(model, x, model_sigma, tiled, scale)
    out = sde_step(strategy, x, velocity, sigma, sigma_next, segment.sigma_max, trajectory_dtype=segment.dtype,
                   prev=prev)
    if flaws.no_transpose:
        log_probs = out.log_prob.reshape(batch, count)
    else:
        log_probs = out.log_prob.reshape(count, batch).transpose(0, 1).contiguous()
    means = out.mean.reshape(count, batch, *out.mean.shape[1:]).transpose(0, 1).contiguous()
    return ReplayResult(log_probs, means, steps)


def _implementation(flaws: Flaws, doc: str):
    def replay_batched(adapter: Any, conditions: Conditions, segment: Any, strategy: Any, target: Sequence[int],
                       guidance: Any = 1.0, config: Any = None) -> ReplayResult | None:
        return _replay(adapter, conditions, segment, strategy, target, guidance, config, flaws)

    replay_batched.__doc__ = doc
    return replay_batched


CORRECT = Flaws()
replay_batched = _implementation(CORRECT, "Right: branch-major tiling, the targets' own guidance, the guards.")
BUGS = {
    "nesting_swapped": (replace(CORRECT, step_major=True),
                        "conditions tiled step-major outside: a fused model's midpoint split mixes the branches"),
    "guidance_at_step_zero": (replace(CORRECT, guidance_step0=True),
                              "the guidance scale read at step 0, not at the targets"),
    "log_probs_not_transposed": (replace(CORRECT, no_transpose=True),
                                 "[S*B] log-probs reshaped straight to [B, S]: columns hold other rows' steps"),
    "targets_sorted": (replace(CORRECT, sorted_targets=True),
                       "targets replayed in sorted order: column s is no longer target[s]"),
    "never_declines": (replace(CORRECT, no_guards=True),
                       "no guards: batches with the flag off, one step, a stateful solver or varying guidance"),
    "one_sigma_for_every_step": (replace(CORRECT, first_sigma=True),
                                 "every stacked row stepped with the first target's sigma"),
    "batches_without_a_config": (replace(CORRECT, missing_config_on=True),
                                 "no config given read as the switch on: batches where it must decline"),
    "velocity_transform_dropped": (replace(CORRECT, own_wrapper=True),
                                   "its own adapter wrapper forwards every hook but velocity: steps on the combined "
                                   "prediction, the family's transform never applied"),
    "next_latents_rounded_to_bf16": (replace(CORRECT, next_latents_bf16=True),
                                     "x_(t+1) cast to bf16 by hard-coding, not kept in the trajectory's dtype"),
}
nesting_swapped = _implementation(*BUGS["nesting_swapped"])
guidance_at_step_zero = _implementation(*BUGS["guidance_at_step_zero"])
log_probs_not_transposed = _implementation(*BUGS["log_probs_not_transposed"])
targets_sorted = _implementation(*BUGS["targets_sorted"])
never_declines = _implementation(*BUGS["never_declines"])
one_sigma_for_every_step = _implementation(*BUGS["one_sigma_for_every_step"])
batches_without_a_config = _implementation(*BUGS["batches_without_a_config"])
velocity_transform_dropped = _implementation(*BUGS["velocity_transform_dropped"])
next_latents_rounded_to_bf16 = _implementation(*BUGS["next_latents_rounded_to_bf16"])
