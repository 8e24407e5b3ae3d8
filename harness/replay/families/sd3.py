"""SD3 / SD3.5 (``diffusers.SD3Transformer2DModel``): uncond-first CFG, standard combine.

Its pipeline builds ``[uncond; cond]`` itself and passes ``timestep = sigma * 1000``; rows carry
``encoder_hidden_states`` and ``pooled_projections``; latents are ``[C, H, W]``.
"""

from __future__ import annotations

import torch

from harness.replay import cfg as cfg_combines
from harness.replay.conditions import Conditions
from harness.replay.denoiser import UNCOND_FIRST
from harness.replay.families.base import ModelAdapter, check_cfg

__all__ = ["SD3_TEXT_TOKENS", "SD3Adapter"]

SD3_TEXT_TOKENS = 5  # prompt tokens of the example conditions


class SD3Adapter(ModelAdapter):
    cfg_layout = UNCOND_FIRST
    cfg_combine = cfg_combines.STANDARD
    channel_dim = 1

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """[C, H, W] latents at the model's own sample size."""
        config = self.module.config
        return (config.in_channels, config.sample_size, config.sample_size)

    def forward(self, hidden: torch.Tensor, timestep: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        rows = conditions.rows
        self.require_rows(conditions, ("encoder_hidden_states", "pooled_projections"), hidden.shape[0])
        return self.module(hidden, encoder_hidden_states=rows["encoder_hidden_states"],
                           pooled_projections=rows["pooled_projections"], timestep=timestep,
                           return_dict=False)[0]

    def example_conditions(self, batch: int, cfg: int, generator: torch.Generator) -> Conditions:
        """Seeded prompt embeddings; cfg=2 adds the uncond branch as ``negative``."""
        check_cfg(cfg)
        joint_dim, pooled_dim = self.module.config.joint_attention_dim, self.module.config.pooled_projection_dim

        def branch() -> Conditions:
            return Conditions(batch=batch, rows={
                "encoder_hidden_states": torch.randn(batch, SD3_TEXT_TOKENS, joint_dim, generator=generator),
                "pooled_projections": torch.randn(batch, pooled_dim, generator=generator)})

        cond = branch()
        return Conditions(batch=batch, rows=cond.rows, negative=branch()) if cfg == 2 else cond
