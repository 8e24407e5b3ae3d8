"""Sana (``diffusers.SanaTransformer2DModel``): uncond-first CFG, standard combine.

SanaPipeline batches ``[negative; prompt]`` itself, embeddings and ``encoder_attention_mask`` alike (a
padded Gemma prompt: 1 = real token), and passes ``timestep = t * timestep_scale`` with its scheduler's
``t = sigma * 1000``. A checkpoint with a learned-sigma head (``out_channels == 2 * in_channels``) has
its prediction cut to the first ``in_channels`` channels, as the pipeline does. Latents are ``[C, H, W]``.
"""

from __future__ import annotations

import torch

from harness.replay import cfg as cfg_combines
from harness.replay.conditions import Conditions
from harness.replay.denoiser import UNCOND_FIRST
from harness.replay.families.base import ModelAdapter, Prompts, padded_prompts, uncond_first_conditions

__all__ = ["SANA_TEXT_TOKENS", "SanaAdapter"]

SANA_TEXT_TOKENS = 8  # padded prompt length: room for distinct lengths in both branches up to B = 4
ROW_FIELDS = ("encoder_hidden_states", "encoder_attention_mask")


class SanaAdapter(ModelAdapter):
    cfg_layout = UNCOND_FIRST
    cfg_combine = cfg_combines.STANDARD

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        return sigma * 1000.0 * float(self.module.config.timestep_scale)

    def forward(self, hidden: torch.Tensor, timestep: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        rows = conditions.rows
        self.require_rows(conditions, ROW_FIELDS, hidden.shape[0])
        self.require_patches(hidden, tuple(hidden.shape[-2:]), self.module.config.patch_size)
        out = self.module(hidden, encoder_hidden_states=rows["encoder_hidden_states"],
                          encoder_attention_mask=rows["encoder_attention_mask"], timestep=timestep,
                          return_dict=False)[0]
        channels = hidden.shape[1]
        return out[:, :channels] if out.shape[1] == 2 * channels else out

    def example_prompts(self, batch: int, cfg: int, generator: torch.Generator) -> Prompts:
        """Seeded padded prompts whose real lengths differ per row and per branch (cfg=2: negatives too)."""
        return padded_prompts(batch, cfg, SANA_TEXT_TOKENS, self.module.config.caption_channels, generator,
                              "prompt_attention_mask")

    def conditions_from_prompts(self, prompts: Prompts, cfg: int) -> Conditions:
        """Each branch's embeddings and mask as its rows (cfg=2: the negative branch under ``negative``)."""
        return uncond_first_conditions(prompts, cfg, {"encoder_hidden_states": "prompt_embeds",
                                                      "encoder_attention_mask": "prompt_attention_mask"})
