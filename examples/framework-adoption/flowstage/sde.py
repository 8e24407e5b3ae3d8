"""Step strategies: the stochastic Flow-GRPO step a rollout samples and a replay scores, and a stateful solver.

Only an ``SDEStrategy`` may have several of its steps stacked into one batch: its step depends on nothing but its
inputs. ``DPM2Strategy`` keeps the previous step's prediction, so its replay stays one step at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["DPM2Strategy", "FlowGRPOStrategy", "SDEStrategy", "StepStrategy"]

_LOG_SQRT_2PI = math.log(math.sqrt(2.0 * math.pi))


class StepStrategy:
    """A sampler step: ``denoise`` returns (next sample, log-prob or None, transition mean or None)."""

    def denoise(self, *, noise_pred: torch.Tensor, sample: torch.Tensor, sigma: torch.Tensor,
                sigma_next: torch.Tensor, eta: float, prev_sample: torch.Tensor | None, sigma_max: torch.Tensor,
                step_index: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        raise NotImplementedError


def _rows(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A scalar or per-row ``[N]`` value shaped to broadcast over ``like`` ``[N, ...]`` (fp32)."""
    value = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if value.dim() == 0:
        value = value.expand(like.shape[0])
    return value.reshape(-1, *([1] * (like.dim() - 1)))


class SDEStrategy(StepStrategy):
    """A stateless stochastic step (its steps may be replayed together)."""


@dataclass
class FlowGRPOStrategy(SDEStrategy):
    """Flow-GRPO's SDE: ``std_t = eta sqrt(sigma / (1 - s'))`` with ``s' = sigma_max`` at ``sigma == 1``; all math in
    fp32; the log-prob of ``prev_sample`` is averaged over every non-batch dim."""

    def denoise(self, *, noise_pred, sample, sigma, sigma_next, eta, prev_sample, sigma_max, step_index=0):
        x, v = sample.float(), noise_pred.float()
        s, s_next = _rows(sigma, x), _rows(sigma_next, x)
        s_prime = torch.where(s == 1.0, torch.as_tensor(sigma_max, dtype=torch.float32), s)
        std_dev_t = eta * torch.sqrt(s / (1.0 - s_prime))
        dt = s_next - s
        mean = x * (1.0 + std_dev_t ** 2 / (2.0 * s) * dt) + v * (1.0 + std_dev_t ** 2 * (1.0 - s) / (2.0 * s)) * dt
        std = std_dev_t * torch.sqrt(-dt)
        if prev_sample is None:
            prev_sample = mean + std * torch.randn_like(mean)
        prev = prev_sample.float()
        log_prob = -((prev - mean) ** 2) / (2.0 * std ** 2) - torch.log(std) - _LOG_SQRT_2PI
        return prev_sample, log_prob.mean(dim=tuple(range(1, log_prob.dim()))), mean


@dataclass
class DPM2Strategy(StepStrategy):
    """A second-order solver that carries the previous prediction from step to step (not an SDE)."""

    history: dict[int, torch.Tensor] = field(default_factory=dict)

    def denoise(self, *, noise_pred, sample, sigma, sigma_next, eta, prev_sample, sigma_max, step_index=0):
        previous = self.history.get(step_index - 1)
        self.history[step_index] = noise_pred.detach()
        drift = noise_pred if previous is None else 1.5 * noise_pred - 0.5 * previous
        x = sample.float() + drift.float() * (_rows(sigma_next, sample) - _rows(sigma, sample))
        return x, None, None
