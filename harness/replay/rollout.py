"""Sample a trajectory with the SDE on selected steps and record pi_old log-probs (docs/contracts.md, replay).

The rollout carries the latent in the trajectory dtype between steps (what a trainer stores), so
replaying a stored step sees exactly the input the rollout saw, and replaying pi_old gives ratio 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from harness.replay.conditions import Conditions
from harness.replay.denoiser import DenoiserAdapter, Guidance, guidance_at, predict_velocity
from harness.replay.sde import SDEStep, SDEStrategy, sde_step
from harness.replay.segment import TrajectorySegment

__all__ = ["draw_sde_step", "flow_sigmas", "rollout"]


def flow_sigmas(steps: int, shift: float = 3.0) -> torch.Tensor:
    """The shifted flow-matching schedule ``[T+1]`` from 1 to 0 (SD3's default shift 3)."""
    if steps < 1:
        raise ValueError(f"a schedule needs at least one step, got {steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    base = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return (shift * base / (1.0 + (shift - 1.0) * base)).to(torch.float32)


def draw_sde_step(strategy: SDEStrategy, x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor,
                  sigma_next: torch.Tensor, sigma_max: torch.Tensor, *, trajectory_dtype: torch.dtype,
                  generator: torch.Generator, step_index: int) -> SDEStep:
    """Draw x_(i+1) and record its pi_old log-prob, scored on the latent as stored (trajectory dtype),
    which is what replay will score again."""
    return sde_step(strategy, x, v, sigma, sigma_next, sigma_max, trajectory_dtype=trajectory_dtype,
                    generator=generator, step_index=step_index)


def rollout(adapter: DenoiserAdapter, conditions: Conditions, strategy: SDEStrategy, sigmas: torch.Tensor,
            sde_indices: Sequence[int], latent_shape: Sequence[int], *, generator: torch.Generator,
            guidance: Guidance | None = None, trajectory_dtype: torch.dtype = torch.bfloat16,
            device: torch.device | str = "cpu", dense: bool = False) -> TrajectorySegment:
    """Run T steps from seeded noise: SDE sampling on ``sde_indices``, the flow ODE elsewhere.

    Stores only the latents replay needs (x_i and x_(i+1) of every SDE step), or, ``dense``, the latent entering
    every step and the final sample (a trainer that keeps the whole trajectory). Noise comes from
    ``generator`` on its own device, so a seed gives the same trajectory whatever ``device`` runs it.
    ``guidance`` (a CFG scale or per-step schedule) may only be left out for conditions without CFG.
    """
    steps = int(sigmas.numel()) - 1
    sde = tuple(sde_indices)
    bad = [i for i in sde if not 0 <= i < steps]
    if not sde or bad or len(set(sde)) != len(sde):
        raise ValueError(f"sde_indices {list(sde)} must be distinct steps in [0, {steps - 1}] (at least one)")
    rows = conditions.validate().batch
    sigmas = sigmas.to(device)
    sigma_max = sigmas[1]
    x = torch.randn((rows, *latent_shape), generator=generator, dtype=torch.float32, device=generator.device)
    x = x.to(device=device, dtype=trajectory_dtype)
    keep = set(range(steps + 1)) if dense else {s for i in sde for s in (i, i + 1)}
    stored: dict[int, torch.Tensor] = {0: x} if 0 in keep else {}
    log_probs: dict[int, torch.Tensor] = {}
    strategy.reset()
    for step in range(steps):
        xf = x.float()
        sigma, sigma_next = sigmas[step].expand(rows), sigmas[step + 1].expand(rows)
        v = predict_velocity(adapter, xf, sigma, conditions, guidance_at(guidance, step))
        if step in sde:
            out = draw_sde_step(strategy, xf, v, sigma, sigma_next, sigma_max, trajectory_dtype=trajectory_dtype,
                                generator=generator, step_index=step)
            x, log_probs[step] = out.prev_sample, out.log_prob
        else:
            x = (xf + v * (sigmas[step + 1] - sigmas[step])).to(trajectory_dtype)
        if step + 1 in keep:
            stored[step + 1] = x
    order = sorted(stored)
    return TrajectorySegment(
        latents=torch.stack([stored[s] for s in order], dim=1),
        latent_steps=tuple(order),
        sigmas=sigmas,
        sde_indices=sde,
        log_probs=torch.stack([log_probs[i] for i in sde], dim=1),
    )
