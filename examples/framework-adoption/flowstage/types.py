"""The framework's typed values: conditions per model, sampling parameters, stored trajectories, replay results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["PRECISIONS", "DiffusionSamplingParams", "HunyuanImage3Conditions", "LatentSegment", "ReplayResult",
           "SD3Conditions", "TextEmbedCondition", "dtype_of"]

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_of(precision: str) -> torch.dtype:
    """A precision knob's dtype (``"bf16"`` -> ``torch.bfloat16``); an unknown knob is a ValueError naming it."""
    try:
        return PRECISIONS[precision]
    except KeyError:
        raise ValueError(f"unknown precision {precision!r}; one of {', '.join(PRECISIONS)}") from None


@dataclass(frozen=True)
class DiffusionSamplingParams:
    """What a rollout was sampled with. One guidance scale per rollout: the runner has no per-step schedule."""

    guidance_scale: float = 4.5
    eta: float = 0.7
    num_inference_steps: int = 8

    def __post_init__(self) -> None:
        if isinstance(self.guidance_scale, bool) or not isinstance(self.guidance_scale, (int, float)):
            raise TypeError(f"guidance_scale is one float per rollout, got {type(self.guidance_scale).__name__}")


@dataclass(frozen=True)
class TextEmbedCondition:
    """One branch's encoded prompt: token embeddings ``[B, T, D]`` and the pooled projection ``[B, P]``."""

    embeds: torch.Tensor
    pooled: torch.Tensor | None = None


@dataclass(frozen=True)
class SD3Conditions:
    """SD3's conditions: the prompt and, for guidance, the negative prompt (the stage batches ``[neg; pos]``)."""

    text: TextEmbedCondition
    negative_text: TextEmbedCondition | None = None


@dataclass(frozen=True)
class HunyuanImage3Conditions:
    """HunyuanImage-3's image-generation sequence, CFG-expanded ``[cond_B; uncond_B]`` as the runner prepares it.

    Every tensor holds one row per sequence (``2B`` with guidance); ``rope_image_info`` one ``[(span, (h, w)), ...]``
    list per row; ``cond_vae_images`` one ``[n, C, h, w]`` tensor per sample (``B``: both branches see the same
    images); ``position_ids`` is every row's ``arange(L)``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    image_mask: torch.Tensor
    timesteps_index: torch.Tensor
    rope_image_info: list[Any]
    cond_vae_images: list[torch.Tensor]
    cond_vae_image_mask: torch.Tensor
    cond_timesteps_index: torch.Tensor
    position_ids: torch.Tensor
    cfg_expanded: bool = True

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class LatentSegment:
    """A stored rollout: ``latents[:, k]`` is the state entering step ``steps[k]`` (in the trajectory dtype)."""

    latents: torch.Tensor
    steps: tuple[int, ...]
    sde_logp: torch.Tensor | None = None
    sde_indices: tuple[int, ...] = ()

    def latents_at(self, step: int) -> torch.Tensor:
        return self.latents[:, self.steps.index(step)]


@dataclass(frozen=True)
class ReplayResult:
    """Replayed log-probs ``[B, S]`` (column s for target[s]) and transition means ``[B, S, *latent]``."""

    log_probs: torch.Tensor
    prev_sample_means: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)
