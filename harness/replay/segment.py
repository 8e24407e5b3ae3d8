"""A sampled trajectory segment and what replaying it returns (docs/contracts.md, replay)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ReplayResult", "TrajectorySegment", "validate_targets"]


@dataclass(frozen=True, eq=False)
class TrajectorySegment:
    """Latents stored at a sparse set of steps, the sigma schedule and the rollout's SDE log-probs.

    ``latents[:, k]`` is the state entering step ``latent_steps[k]`` (x_T is the final sample), in the
    trajectory dtype. Step i goes ``sigmas[i] -> sigmas[i+1]``; replaying step i needs x_i and x_{i+1}.
    ``log_probs[:, j]`` is the pi_old log-prob the rollout recorded for step ``sde_indices[j]``.
    """

    latents: torch.Tensor
    latent_steps: tuple[int, ...]
    sigmas: torch.Tensor
    sde_indices: tuple[int, ...]
    log_probs: torch.Tensor

    def __post_init__(self) -> None:
        if self.sigmas.dim() != 1 or self.sigmas.numel() < 2:
            raise ValueError(f"sigmas must be a [T+1] schedule with T >= 1, got shape {tuple(self.sigmas.shape)}")
        if self.sigmas.dtype != torch.float32:
            raise TypeError(f"sigmas must be float32 (all SDE math is fp32), got {self.sigmas.dtype}")
        if not bool((self.sigmas[1:] < self.sigmas[:-1]).all()):
            raise ValueError(f"sigmas must decrease strictly, got {self.sigmas.tolist()}")
        if self.latents.dim() < 3:
            raise ValueError(f"latents must be [B, K, *latent], got shape {tuple(self.latents.shape)}")
        if len(self.latent_steps) != self.latents.shape[1] or len(set(self.latent_steps)) != len(self.latent_steps):
            raise ValueError(f"latent_steps {self.latent_steps} must name {self.latents.shape[1]} distinct steps "
                             "(one per stored latent)")
        steps = self.num_steps
        outside = [s for s in self.latent_steps if not 0 <= s <= steps]
        if outside:
            raise ValueError(f"latent_steps {outside} lie outside [0, {steps}]")
        if len(set(self.sde_indices)) != len(self.sde_indices):
            raise ValueError(f"sde_indices {self.sde_indices} hold duplicates")
        bad = [i for i in self.sde_indices if not 0 <= i < steps]
        if bad:
            raise ValueError(f"sde_indices {bad} lie outside [0, {steps - 1}] (T={steps} steps)")
        stored = set(self.latent_steps)
        missing = sorted({s for i in self.sde_indices for s in (i, i + 1)} - stored)
        if missing:
            raise ValueError(f"latents for steps {missing} are not stored; each SDE step i needs x_i and x_(i+1)")
        expected = (self.batch, len(self.sde_indices))
        if tuple(self.log_probs.shape) != expected:
            raise ValueError(f"log_probs must be [B, S_all] = {list(expected)}, got {list(self.log_probs.shape)}")

    @property
    def batch(self) -> int:
        return int(self.latents.shape[0])

    @property
    def num_steps(self) -> int:
        """T, the number of sampler steps."""
        return int(self.sigmas.numel()) - 1

    @property
    def sigma_max(self) -> torch.Tensor:
        """schedule[1]: the s' Flow-GRPO uses in place of sigma == 1."""
        return self.sigmas[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.latents.dtype

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return tuple(self.latents.shape[2:])

    def latent_at(self, step: int) -> torch.Tensor:
        """x_step, ``[B, *latent]`` in the trajectory dtype."""
        try:
            k = self.latent_steps.index(step)
        except ValueError:
            raise ValueError(f"no latent stored for step {step}; stored: {sorted(self.latent_steps)}") from None
        return self.latents[:, k]

    def recorded_log_probs(self, target: Sequence[int]) -> torch.Tensor:
        """The rollout's pi_old log-probs for ``target``, ``[B, S]``."""
        columns = [self.sde_indices.index(step) for step in validate_targets(self, target)]
        return self.log_probs[:, columns]


def validate_targets(segment: TrajectorySegment, target: Sequence[int]) -> tuple[int, ...]:
    """Targets may be any order and any non-empty subset of sde_indices; anything else names the bad steps."""
    if isinstance(target, (str, bytes)) or not isinstance(target, Sequence):
        raise TypeError(f"target must be a sequence of step indices, got {type(target).__name__}")
    steps = tuple(target)
    if not steps:
        raise ValueError("target is empty; name at least one step of sde_indices")
    not_int = [s for s in steps if isinstance(s, bool) or not isinstance(s, int)]
    if not_int:
        raise TypeError(f"target steps must be ints, got {not_int!r}")
    dup = sorted({s for s in steps if steps.count(s) > 1})
    if dup:
        raise ValueError(f"target steps {dup} appear more than once in {list(steps)}")
    unknown = [s for s in steps if s not in segment.sde_indices]
    if unknown:
        raise ValueError(f"target steps {unknown} are not SDE steps of this segment "
                         f"(sde_indices={list(segment.sde_indices)})")
    return steps


@dataclass(frozen=True, eq=False)
class ReplayResult:
    """log_probs ``[B, S]`` and transition means ``[B, S, *latent]``; column s is ``target[s]``."""

    log_probs: torch.Tensor
    prev_sample_means: torch.Tensor
    target: tuple[int, ...]
