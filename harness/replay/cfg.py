"""The CFG combines a replay family can choose: how the cond and uncond velocities become one.

Stock and batched replay both call the family's combine through ``predict_velocity``, so a combine
bug hits both alike; the oracle checks hold these functions to their formulas.

- ``standard``: ``uncond + g (cond - uncond)`` (SD3, Flux and HunyuanImage-3 pipelines).
- ``true_cfg_norm_rescale``: the standard combine rescaled so each position keeps the norm of the
  cond prediction over the channel dim (diffusers' QwenImagePipeline: ``comb * ||cond|| / ||comb||``
  with the norm over the last dim of its packed ``[N, L, C*4]`` latents).
Each combine is a module-level function (a seam an ablation can replace); ``combine`` looks the
name up at call time.
"""

from __future__ import annotations

import torch

__all__ = ["COMBINES", "STANDARD", "TRUE_CFG_NORM_RESCALE", "combine", "standard_cfg", "true_cfg_norm_rescale"]

STANDARD = "standard"
TRUE_CFG_NORM_RESCALE = "true_cfg_norm_rescale"
COMBINES = (STANDARD, TRUE_CFG_NORM_RESCALE)


def standard_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """``uncond + scale (cond - uncond)``."""
    return uncond + scale * (cond - uncond)


def true_cfg_norm_rescale(cond: torch.Tensor, uncond: torch.Tensor, scale: float, dim: int) -> torch.Tensor:
    """The standard combine times ``||cond|| / ||combined||``, norms taken over ``dim`` (the channels)."""
    combined = uncond + scale * (cond - uncond)
    cond_norm = torch.linalg.vector_norm(cond, dim=dim, keepdim=True)
    combined_norm = torch.linalg.vector_norm(combined, dim=dim, keepdim=True)
    return combined * (cond_norm / combined_norm)


def combine(kind: str, cond: torch.Tensor, uncond: torch.Tensor, scale: float, *, channel_dim: int) -> torch.Tensor:
    """Dispatch to the combine named ``kind``; an unknown name lists the known ones."""
    if cond.shape != uncond.shape:
        raise ValueError(f"CFG combine: cond {tuple(cond.shape)} and uncond {tuple(uncond.shape)} differ in shape")
    if kind == STANDARD:
        return standard_cfg(cond, uncond, scale)
    if kind == TRUE_CFG_NORM_RESCALE:
        return true_cfg_norm_rescale(cond, uncond, scale, channel_dim)
    raise ValueError(f"unknown CFG combine {kind!r}; known: {', '.join(COMBINES)}")
