"""SD3 / SD3.5 (``diffusers.SD3Transformer2DModel``): uncond-first CFG, standard combine.

StableDiffusion3Pipeline batches ``[negative; prompt]`` itself and passes ``timestep = sigma * 1000``;
rows carry ``encoder_hidden_states`` and ``pooled_projections`` per branch; latents are ``[C, H, W]``.
"""

from __future__ import annotations

import torch

from harness.replay import cfg as cfg_combines
from harness.replay.conditions import Conditions
from harness.replay.denoiser import UNCOND_FIRST
from harness.replay.families.base import ModelAdapter, Prompts, check_cfg, uncond_first_conditions

__all__ = ["SD3_TEXT_TOKENS", "SD3Adapter"]

SD3_TEXT_TOKENS = 5  # prompt tokens of the example conditions


class SD3Adapter(ModelAdapter):
    cfg_layout = UNCOND_FIRST
    cfg_combine = cfg_combines.STANDARD

    def forward(self, hidden: torch.Tensor, timestep: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        rows = conditions.rows
        self.require_rows(conditions, ("encoder_hidden_states", "pooled_projections"), hidden.shape[0])
        self.require_patches(hidden, tuple(hidden.shape[-2:]), self.module.config.patch_size)
        return self.module(hidden, encoder_hidden_states=rows["encoder_hidden_states"],
                           pooled_projections=rows["pooled_projections"], timestep=timestep,
                           return_dict=False)[0]

    def example_prompts(self, batch: int, cfg: int, generator: torch.Generator) -> Prompts:
        """Seeded joint prompt embeddings and pooled projections (cfg=2: the negative ones too)."""
        check_cfg(cfg)
        joint_dim, pooled_dim = self.module.config.joint_attention_dim, self.module.config.pooled_projection_dim
        prompts = {}
        for prefix in ("", "negative_")[:cfg]:
            prompts[f"{prefix}prompt_embeds"] = torch.randn(batch, SD3_TEXT_TOKENS, joint_dim, generator=generator)
            prompts[f"{prefix}pooled_prompt_embeds"] = torch.randn(batch, pooled_dim, generator=generator)
        return prompts

    def conditions_from_prompts(self, prompts: Prompts, cfg: int) -> Conditions:
        """Each branch's embeddings as its rows; cfg=2 puts the negative branch under ``negative``."""
        return uncond_first_conditions(prompts, cfg, {"encoder_hidden_states": "prompt_embeds",
                                                      "pooled_projections": "pooled_prompt_embeds"})
