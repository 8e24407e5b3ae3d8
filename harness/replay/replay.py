"""Serial replay (stock) and batched-step replay (fast) side by side, with one signature.

Stock: one forward on the B-row (CFG-expanded) batch and one SDE step per target. Fast: latents
stacked step-major to ``[S*B, ...]``, sigmas to ``[S*B]`` vectors, conditions tiled, ONE forward and
ONE vectorised SDE step, log-probs ``[S*B] -> [S, B] -> [B, S]``. The fast path returns None when a
guard declines; ``replay`` then falls back to the serial loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from harness.replay import guards, tiling
from harness.replay.conditions import Conditions
from harness.replay.denoiser import UNGUIDED_CFG, DenoiserAdapter, Guidance, guidance_at, predict_velocity
from harness.replay.guards import ReplayConfig
from harness.replay.sde import SDEStrategy, sde_step
from harness.replay.segment import ReplayResult, TrajectorySegment, validate_targets

__all__ = ["batched_velocity", "replay", "replay_batched", "replay_serial", "step_sigma_vectors",
           "stored_next_latents"]


def _check_inputs(conditions: Conditions, segment: TrajectorySegment, guidance: Guidance | None,
                  steps: Sequence[int]) -> None:
    conditions.validate()
    if conditions.batch != segment.batch:
        raise ValueError(f"conditions are for batch {conditions.batch} but the segment holds {segment.batch} samples")
    if guidance is None and conditions.guided:
        raise ValueError(UNGUIDED_CFG)
    for step in steps:
        guidance_at(guidance, step)


def replay_serial(adapter: DenoiserAdapter, conditions: Conditions, segment: TrajectorySegment,
                  strategy: SDEStrategy, target: Sequence[int], guidance: Guidance | None = None,
                  config: ReplayConfig | None = None) -> ReplayResult:
    """The stock loop: one forward of B (x CFG) rows per target step."""
    steps = validate_targets(segment, target)
    _check_inputs(conditions, segment, guidance, steps)
    rows = segment.batch
    strategy.reset()
    log_probs, means = [], []
    for step in steps:
        x = segment.latent_at(step).float()
        sigma = segment.sigmas[step].expand(rows)
        sigma_next = segment.sigmas[step + 1].expand(rows)
        v = predict_velocity(adapter, x, sigma, conditions, guidance_at(guidance, step))
        out = sde_step(strategy, x, v, sigma, sigma_next, segment.sigma_max, trajectory_dtype=segment.dtype,
                       prev=segment.latent_at(step + 1), step_index=step)
        log_probs.append(out.log_prob)
        means.append(out.mean)
    return ReplayResult(torch.stack(log_probs, dim=1), torch.stack(means, dim=1), steps)


def step_sigma_vectors(sigmas: torch.Tensor, steps: Sequence[int], batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (sigma, sigma_next) ``[S*B]`` for the step-major stacked batch."""
    index = torch.tensor(list(steps), dtype=torch.long, device=sigmas.device).repeat_interleave(batch)
    return sigmas[index], sigmas[index + 1]


def stored_next_latents(segment: TrajectorySegment, steps: Sequence[int]) -> torch.Tensor:
    """x_(i+1) of every target step, stacked step-major ``[S*B, ...]``: what the batched step scores."""
    return tiling.stack_step_major([segment.latent_at(step + 1) for step in steps])


def batched_velocity(adapter: DenoiserAdapter, x: torch.Tensor, sigma: torch.Tensor, tiled: Conditions,
                     guidance_scale: float | None) -> torch.Tensor:
    """The velocity of the one stacked forward: the family's forward, combine and velocity transform, as stock."""
    return predict_velocity(adapter, x, sigma, tiled, guidance_scale)


def replay_batched(adapter: DenoiserAdapter, conditions: Conditions, segment: TrajectorySegment,
                   strategy: SDEStrategy, target: Sequence[int], guidance: Guidance | None = None,
                   config: ReplayConfig | None = None) -> ReplayResult | None:
    """All S target steps in one forward of S*B (x CFG) rows, or None when a guard declines."""
    steps = validate_targets(segment, target)
    _check_inputs(conditions, segment, guidance, steps)
    if guards.fallback_reason(guards.resolve_config(config), strategy, steps, guidance) is not None:
        return None
    count, rows = len(steps), segment.batch
    x = tiling.stack_step_major([segment.latent_at(step) for step in steps]).float()
    prev = stored_next_latents(segment, steps)
    sigma, sigma_next = step_sigma_vectors(segment.sigmas, steps, rows)
    tiled = tiling.tile_conditions(conditions, count)
    v = batched_velocity(adapter, x, sigma, tiled, guidance_at(guidance, steps[0]))
    out = sde_step(strategy, x, v, sigma, sigma_next, segment.sigma_max, trajectory_dtype=segment.dtype, prev=prev)
    return ReplayResult(tiling.reshape_log_probs(out.log_prob, count, rows),
                        tiling.unstack_step_major(out.mean, count, rows), steps)


def replay(adapter: DenoiserAdapter, conditions: Conditions, segment: TrajectorySegment, strategy: SDEStrategy,
           target: Sequence[int], guidance: Guidance | None = None, config: ReplayConfig | None = None) -> ReplayResult:
    """What a trainer calls: the batched path when it may run, else the serial loop."""
    result = replay_batched(adapter, conditions, segment, strategy, target, guidance, config)
    if result is not None:
        return result
    return replay_serial(adapter, conditions, segment, strategy, target, guidance, config)
