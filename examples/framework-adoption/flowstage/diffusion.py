"""The diffusion stage every model's stage derives from: its kernel step, its serial replay and the batched hook.

``replay`` scores a stored trajectory's SDE transitions: it asks ``_replay_batched`` first (one transformer forward
for every target step, stacked step-major on the batch dim) and replays serially, one forward per step, when that
returns None. A model's stage brings ``predict_noise`` (its CFG batching) and ``_tile_conditions`` (how its
conditions repeat for S stacked steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from flowstage.sde import SDEStrategy, StepStrategy
from flowstage.types import DiffusionSamplingParams, LatentSegment, ReplayResult, dtype_of

__all__ = ["DiffusionStage"]


class DiffusionStage:
    """A model's rollout and replay stage. ``trajectory_precision`` is the dtype latents are stored in and transition
    means come back in; ``logprob_precision`` the log-probs'. ``batch_replay_steps`` opts into the one-forward
    replay (off by default)."""

    def __init__(self, *, model: Any, strategy: StepStrategy, trajectory_precision: str = "bf16",
                 logprob_precision: str = "fp32", batch_replay_steps: bool = False) -> None:
        self.model = model
        self.strategy = strategy
        self.trajectory_dtype = dtype_of(trajectory_precision)
        self.logprob_dtype = dtype_of(logprob_precision)
        self.batch_replay_steps = batch_replay_steps

    # ---------------------------------------------------------------- what a model's stage brings
    def predict_noise(self, sample: torch.Tensor, sigma: torch.Tensor, conditions: Any, *,
                      guidance_scale: float) -> torch.Tensor:
        raise NotImplementedError

    def _tile_conditions(self, conditions: Any, repeats: int) -> Any:
        raise NotImplementedError

    # ---------------------------------------------------------------- one step
    def step_with_logp(self, conditions: Any, *, sample: torch.Tensor, sigma: torch.Tensor,
                       sigma_next: torch.Tensor, guidance_scale: float, prev_sample: torch.Tensor | None,
                       sigma_max: torch.Tensor, eta: float, step_index: int = 0):
        noise_pred = self.predict_noise(sample, sigma, conditions, guidance_scale=guidance_scale)
        return self.strategy.denoise(noise_pred=noise_pred, sample=sample, sigma=sigma, sigma_next=sigma_next,
                                     eta=eta, prev_sample=prev_sample, sigma_max=sigma_max, step_index=step_index)

    # ---------------------------------------------------------------- replay
    def replay(self, conditions: Any, *, segment: LatentSegment, params: DiffusionSamplingParams,
               target: Sequence[int], sigmas: torch.Tensor, device: torch.device) -> ReplayResult:
        sigma_max = sigmas[1]
        fast = self._replay_batched(conditions, segment=segment, params=params, target=list(target), sigmas=sigmas,
                                    sigma_max=sigma_max, device=device)
        if fast is not None:
            return fast
        log_probs, means = [], []
        for i in target:
            _, logp, mean = self.step_with_logp(
                conditions, sample=segment.latents_at(i).to(device).float(), sigma=sigmas[i], sigma_next=sigmas[i + 1],
                guidance_scale=float(params.guidance_scale), prev_sample=segment.latents_at(i + 1).to(device),
                sigma_max=sigma_max, eta=float(params.eta), step_index=i)
            log_probs.append(logp)
            means.append(mean)
        return ReplayResult(torch.stack(log_probs, dim=1).to(self.logprob_dtype),
                            torch.stack(means, dim=1).to(self.trajectory_dtype))

    def _replay_batched(self, conditions: Any, *, segment: LatentSegment, params: DiffusionSamplingParams,
                        target: list[int], sigmas: torch.Tensor, sigma_max: Any,
                        device: torch.device) -> ReplayResult | None:
        """The runner's one-forward hook: None leaves the replay to the serial loop."""
        if self.batch_replay_steps and len(target) > 1 and isinstance(self.strategy, SDEStrategy):
            return self._replay_batched_steps(conditions, segment=segment, params=params, target=target,
                                              sigmas=sigmas, sigma_max=sigma_max, device=device)
        return None

    def _replay_batched_steps(self, conditions: Any, *, segment: LatentSegment, params: DiffusionSamplingParams,
                              target: list[int], sigmas: torch.Tensor, sigma_max: Any,
                              device: torch.device) -> ReplayResult:
        """All target steps in one forward: rows ``[k*B, (k+1)*B)`` of the stack are the B samples at target[k]."""
        steps = len(target)
        sample = torch.cat([segment.latents_at(i).to(device) for i in target], dim=0).float()
        prev = torch.cat([segment.latents_at(i + 1).to(device) for i in target], dim=0)
        batch = sample.shape[0] // steps
        sigma = torch.cat([sigmas[i].float().expand(batch) for i in target])
        sigma_next = torch.cat([sigmas[i + 1].float().expand(batch) for i in target])
        _, log_prob, mean = self.step_with_logp(
            self._tile_conditions(conditions, steps), sample=sample, sigma=sigma, sigma_next=sigma_next,
            guidance_scale=float(params.guidance_scale), prev_sample=prev, sigma_max=sigma_max, eta=float(params.eta),
            step_index=int(target[0]))
        log_probs = log_prob.view(steps, batch).transpose(0, 1).contiguous().to(self.logprob_dtype)
        means = mean.view(steps, batch, *mean.shape[1:]).transpose(0, 1).contiguous().to(self.trajectory_dtype)
        return ReplayResult(log_probs, means)
