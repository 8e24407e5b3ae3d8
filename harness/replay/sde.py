"""SDE transitions of the flow-matching sampler and their Gaussian log-probs (docs/contracts.md, replay).

All math is fp32. sigma / sigma_next may be 0-d scalars or per-row vectors ``[N]`` (the batched
replay mixes steps in one batch, so each row carries its own sigma). Per-row coefficients use only
IEEE-exact operations (+, -, *, /, sqrt); the transcendental log runs on full latent-shaped tensors,
so a row computes the same bits whether it sits in a batch of B or of S*B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = [
    "ConstantStdSDE",
    "FlowGRPOSDE",
    "MultistepSDE",
    "SDEStep",
    "SDEStrategy",
    "as_rows",
    "gaussian_log_prob",
    "sde_step",
    "step_std",
]

LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def as_rows(sigma: torch.Tensor | float, rows: int) -> torch.Tensor:
    """A sigma as an fp32 vector ``[rows]``: a scalar is broadcast, a vector must have ``rows`` entries."""
    value = torch.as_tensor(sigma, dtype=torch.float32)
    if value.dim() == 0:
        return value.expand(rows)
    if value.shape != (rows,):
        raise ValueError(f"sigma must be a scalar or a per-row vector of {rows} entries, got shape "
                         f"{tuple(value.shape)}")
    return value


def _per_row(vector: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return vector.reshape(-1, *([1] * (like.dim() - 1)))


def flow_mean(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
              std_t: torch.Tensor) -> torch.Tensor:
    """mean = x (1 + std_t^2/(2 sigma) dt) + v (1 + std_t^2 (1 - sigma)/(2 sigma)) dt, dt = sigma_next - sigma."""
    dt = sigma_next - sigma
    var_t = std_t * std_t
    x_coef = 1.0 + var_t / (2.0 * sigma) * dt
    v_coef = (1.0 + var_t * (1.0 - sigma) / (2.0 * sigma)) * dt
    return x * _per_row(x_coef, x) + v * _per_row(v_coef, v)


def step_std(std_t: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
    """The transition's std: std_t * sqrt(-dt), dt = sigma_next - sigma (per row)."""
    return std_t * torch.sqrt(sigma - sigma_next)


class SDEStrategy:
    """A stochastic sampler step: ``transition`` gives the Gaussian (mean, std) of x_{i+1} | x_i.

    ``stateless`` strategies depend only on their inputs, so S steps may run as one batch.
    """

    stateless: bool = True

    def reset(self) -> None:
        """Forget any cross-step state (a no-op for stateless strategies)."""

    def std_t(self, sigma: torch.Tensor, sigma_max: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def transition(self, x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor | float,
                   sigma_next: torch.Tensor | float, sigma_max: torch.Tensor | float, *,
                   step_index: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean ``[N, *latent]``, std ``[N]``) of the step's Gaussian, in fp32."""
        rows = x.shape[0]
        sig, nxt = as_rows(sigma, rows), as_rows(sigma_next, rows)
        if bool((nxt >= sig).any()):
            raise ValueError("an SDE step needs sigma_next < sigma on every row (dt < 0)")
        std_t = self.std_t(sig, torch.as_tensor(sigma_max, dtype=torch.float32))
        mean = flow_mean(x.float(), v.float(), sig, nxt, std_t)
        return mean, step_std(std_t, sig, nxt)


@dataclass
class FlowGRPOSDE(SDEStrategy):
    """Flow-GRPO: std_t = eta sqrt(sigma / (1 - s')), s' = sigma_max where sigma == 1 else sigma."""

    eta: float = 0.7

    def std_t(self, sigma: torch.Tensor, sigma_max: torch.Tensor) -> torch.Tensor:
        s_prime = torch.where(sigma == 1.0, sigma_max.expand_as(sigma), sigma)
        return self.eta * torch.sqrt(sigma / (1.0 - s_prime))


@dataclass
class ConstantStdSDE(SDEStrategy):
    """A second stateless flavour: std_t = eta on every step."""

    eta: float

    def std_t(self, sigma: torch.Tensor, sigma_max: torch.Tensor) -> torch.Tensor:
        return torch.full_like(sigma, self.eta)


@dataclass
class MultistepSDE(SDEStrategy):
    """A stateful two-step (Adams-Bashforth) SDE: the drift extrapolates the previous step's velocity.

    It consumes ``step_index`` and carries history, so its steps cannot be stacked on the batch dim;
    the batched replay must refuse it.
    """

    eta: float = 0.7
    stateless: bool = False
    history: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def reset(self) -> None:
        self.history.clear()

    def std_t(self, sigma: torch.Tensor, sigma_max: torch.Tensor) -> torch.Tensor:
        return FlowGRPOSDE(self.eta).std_t(sigma, sigma_max)

    def transition(self, x, v, sigma, sigma_next, sigma_max, *, step_index=None):
        if step_index is None:
            raise ValueError("MultistepSDE needs step_index (it extrapolates from the previous step)")
        previous = self.history.get(step_index - 1)
        self.history[step_index] = v.detach().float()
        drift = v if previous is None or previous.shape != v.shape else 1.5 * v - 0.5 * previous
        return super().transition(x, drift, sigma, sigma_next, sigma_max, step_index=step_index)


def gaussian_log_prob(prev: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Per-row log N(prev; mean, std^2), averaged over all non-batch dims -> ``[N]`` (fp32)."""
    std_full = _per_row(std, mean).expand_as(mean).contiguous()
    diff = prev.float() - mean
    elementwise = -(diff * diff) / (2.0 * (std_full * std_full)) - torch.log(std_full) - LOG_SQRT_2PI
    return elementwise.mean(dim=tuple(range(1, elementwise.dim())))


@dataclass(frozen=True)
class SDEStep:
    """One SDE transition: the stored next latent (trajectory dtype), its log-prob, mean and std."""

    prev_sample: torch.Tensor
    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


def sde_step(strategy: SDEStrategy, x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor | float,
             sigma_next: torch.Tensor | float, sigma_max: torch.Tensor | float, *,
             trajectory_dtype: torch.dtype, prev: torch.Tensor | None = None,
             generator: torch.Generator | None = None, step_index: int | None = None) -> SDEStep:
    """Sample (``prev is None``) or score (``prev`` given) one transition.

    prev is round-tripped through the trajectory dtype before scoring, so the log-prob recorded at
    rollout is the one replay recomputes from the stored latent.
    """
    mean, std = strategy.transition(x, v, sigma, sigma_next, sigma_max, step_index=step_index)
    if prev is None:
        where = generator.device if generator is not None else mean.device
        noise = torch.randn(mean.shape, generator=generator, dtype=torch.float32, device=where).to(mean.device)
        prev = mean + _per_row(std, mean) * noise
    elif prev.shape != mean.shape:
        raise ValueError(f"prev has shape {tuple(prev.shape)}, expected {tuple(mean.shape)}")
    stored = prev.to(trajectory_dtype)
    return SDEStep(stored, gaussian_log_prob(stored, mean, std), mean, std)
