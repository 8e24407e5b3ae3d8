"""Independent fp64 oracles for what stock and batched replay share (docs/contracts.md, replay).

Parity proves fast == stock; it cannot prove stock right, because both call the same SDE step,
log-prob and CFG combine. These functions are written again from the formulas in docs/contracts.md, in
float64 and without importing the implementation, so a bug in the shared code shows up as a
difference between the implementation and its oracle. Every input is a tensor; every output is fp64.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "cfg_standard64",
    "constant_std_t64",
    "flow_grpo_std_t64",
    "flow_mean64",
    "gaussian_log_prob64",
    "std64",
]


def _column(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-row vector ``[N]`` shaped to broadcast against ``like`` ``[N, ...]``."""
    return values.reshape(-1, *([1] * (like.dim() - 1)))


def flow_grpo_std_t64(sigma: torch.Tensor, sigma_max: float, eta: float) -> torch.Tensor:
    """std_t = eta sqrt(sigma / (1 - s')), s' = sigma_max where sigma == 1, else sigma."""
    sig = sigma.double()
    s_prime = torch.where(sig == 1.0, torch.full_like(sig, float(sigma_max)), sig)
    return eta * torch.sqrt(sig / (1.0 - s_prime))


def constant_std_t64(sigma: torch.Tensor, eta: float) -> torch.Tensor:
    """The constant-std flavour: std_t = eta on every row."""
    return torch.full_like(sigma.double(), float(eta))


def flow_mean64(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
                std_t: torch.Tensor) -> torch.Tensor:
    """mean = x (1 + std_t^2 / (2 sigma) dt) + v (1 + std_t^2 (1 - sigma) / (2 sigma)) dt."""
    sig, dt = sigma.double(), sigma_next.double() - sigma.double()
    var = std_t.double() ** 2
    x_coef = 1.0 + var / (2.0 * sig) * dt
    v_coef = (1.0 + var * (1.0 - sig) / (2.0 * sig)) * dt
    return x.double() * _column(x_coef, x) + v.double() * _column(v_coef, v)


def std64(std_t: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
    """std = std_t sqrt(-dt)."""
    return std_t.double() * torch.sqrt(sigma.double() - sigma_next.double())


def gaussian_log_prob64(prev: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Per-row mean over non-batch dims of -(prev - mean)^2 / (2 std^2) - log std - log sqrt(2 pi)."""
    p, m = prev.double(), mean.double()
    s = _column(std.double(), m)
    element = -((p - m) ** 2) / (2.0 * s * s) - torch.log(s) - 0.5 * math.log(2.0 * math.pi)
    return element.reshape(element.shape[0], -1).mean(dim=1)


def cfg_standard64(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """The standard classifier-free guidance combine: uncond + scale (cond - uncond)."""
    c, u = cond.double(), uncond.double()
    return u + float(scale) * (c - u)
