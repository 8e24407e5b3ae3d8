"""SD3: the transformer batches ``[uncond; cond]`` itself (its pipeline's CFG), timestep ``1000 sigma``."""

from __future__ import annotations

import dataclasses

import torch

from flowstage.diffusion import DiffusionStage
from flowstage.types import SD3Conditions, TextEmbedCondition

__all__ = ["SD3DiffusionStage"]


def _tile(text: TextEmbedCondition, repeats: int) -> TextEmbedCondition:
    """Whole blocks: row r of the tiled batch is row r mod B (the S stacked steps are step-major)."""
    pooled = None if text.pooled is None else text.pooled.repeat(repeats, 1)
    return TextEmbedCondition(text.embeds.repeat(repeats, 1, 1), pooled)


class SD3DiffusionStage(DiffusionStage):
    """SD3's stage: CFG batched ``[negative; prompt]`` in one forward when ``guidance_scale > 1``."""

    def predict_noise(self, sample: torch.Tensor, sigma: torch.Tensor, conditions: SD3Conditions, *,
                      guidance_scale: float) -> torch.Tensor:
        transformer = self.model
        timestep = (torch.as_tensor(sigma, dtype=torch.float32) * 1000.0).expand(sample.shape[0])
        text = conditions.text
        if guidance_scale <= 1.0:
            return transformer(hidden_states=sample, encoder_hidden_states=text.embeds, timestep=timestep,
                               pooled_projections=text.pooled, return_dict=False)[0]
        negative = conditions.negative_text
        if negative is None:
            raise ValueError("SD3DiffusionStage: guidance_scale > 1 needs conditions.negative_text")
        noise = transformer(hidden_states=torch.cat([sample, sample]),
                            encoder_hidden_states=torch.cat([negative.embeds, text.embeds]),
                            timestep=torch.cat([timestep, timestep]),
                            pooled_projections=torch.cat([negative.pooled, text.pooled]), return_dict=False)[0]
        uncond, cond = noise.chunk(2, dim=0)
        return uncond + guidance_scale * (cond - uncond)

    def _tile_conditions(self, conditions: SD3Conditions, repeats: int) -> SD3Conditions:
        negative = None if conditions.negative_text is None else _tile(conditions.negative_text, repeats)
        return dataclasses.replace(conditions, text=_tile(conditions.text, repeats), negative_text=negative)
