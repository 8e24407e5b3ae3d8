"""A batched replay from outside the suite, put under test with ``--impl replay=MODULE:CALLABLE``.

Signature: ``replay_batched(adapter, conditions, segment, strategy, target, guidance=1.0, config=None)``
returning a ``harness.replay.segment.ReplayResult`` (log_probs [B, S], prev_sample_means [B, S, ...])
or None when it declines. ``replay_batched`` stacks the S target steps into one forward with the
conditions tiled branch-major (``[cond x S, uncond x S]``: the model splits its CFG batch at the
midpoint); ``replay_batched_nesting_swapped`` is the known bug the suite must catch, the same code
with the nesting backwards (``[cond, uncond] x S``), which mixes branches at the midpoint.

It is written against the suite's replay API on main when this example was written (Conditions,
predict_velocity, sde_step); where that contract changes, adapt the body, not the bug.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from harness.replay.conditions import Conditions, concat_payloads, payload_rows, slice_rows
from harness.replay.denoiser import guidance_at, predict_velocity
from harness.replay.guards import ReplayConfig, fallback_reason
from harness.replay.sde import sde_step
from harness.replay.segment import ReplayResult, validate_targets

__all__ = ["replay_batched", "replay_batched_nesting_swapped"]

Nesting = Callable[[list, int], list]


def _branch_major(groups: list, repeats: int) -> list:
    return [group for group in groups for _ in range(repeats)]


def _step_major(groups: list, repeats: int) -> list:
    return [group for _ in range(repeats) for group in groups]


def _tile(conditions: Conditions, repeats: int, nesting: Nesting) -> Conditions:
    """Every row field to ``cfg * repeats * batch`` rows, its branch groups ordered by ``nesting``."""
    batch, cfg = conditions.batch, conditions.cfg_factor
    rows = {}
    for name, value in conditions.rows.items():
        count = payload_rows(value, f"field {name!r}")
        groups = [slice_rows(value, b * batch, (b + 1) * batch) for b in range(cfg)] if count == batch * cfg \
            else [value] * cfg
        rows[name] = concat_payloads(nesting(groups, repeats))
    negative = None if conditions.negative is None else _tile(conditions.negative, repeats, nesting)
    return dataclasses.replace(conditions, batch=batch * repeats, rows=rows, negative=negative, fused_uncond=None)


def _replay(nesting: Nesting, adapter, conditions: Conditions, segment, strategy, target: Sequence[int],
            guidance=1.0, config=None) -> ReplayResult | None:
    steps = validate_targets(segment, target)
    conditions.validate()
    if conditions.batch != segment.batch:
        raise ValueError(f"conditions are for batch {conditions.batch} but the segment holds {segment.batch} samples")
    if fallback_reason(config or ReplayConfig(), strategy, steps, guidance) is not None:
        return None  # declined (the suite's guard rules): the caller replays serially
    count, batch = len(steps), segment.batch
    x = torch.cat([segment.latent_at(step) for step in steps]).float()
    prev = torch.cat([segment.latent_at(step + 1) for step in steps])
    index = torch.tensor(list(steps)).repeat_interleave(batch)
    sigma, sigma_next = segment.sigmas[index], segment.sigmas[index + 1]
    tiled = conditions if count == 1 else _tile(conditions, count, nesting)
    v = predict_velocity(adapter, x, sigma, tiled, guidance_at(guidance, steps[0]))
    out = sde_step(strategy, x, v, sigma, sigma_next, segment.sigma_max, trajectory_dtype=segment.dtype, prev=prev)
    log_probs = out.log_prob.reshape(count, batch).transpose(0, 1).contiguous()
    means = out.mean.reshape(count, batch, *out.mean.shape[1:]).transpose(0, 1).contiguous()
    return ReplayResult(log_probs, means, steps)


def replay_batched(adapter, conditions, segment, strategy, target, guidance=1.0, config=None) -> ReplayResult | None:
    """All target steps in one forward, conditions tiled branch-major (right)."""
    return _replay(_branch_major, adapter, conditions, segment, strategy, target, guidance, config)


def replay_batched_nesting_swapped(adapter, conditions, segment, strategy, target, guidance=1.0,
                                   config=None) -> ReplayResult | None:
    """The bug: conditions tiled step-major outside, so the midpoint split mixes cond and uncond rows."""
    return _replay(_step_major, adapter, conditions, segment, strategy, target, guidance, config)
