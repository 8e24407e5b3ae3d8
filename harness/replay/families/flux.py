"""Flux (``diffusers.FluxTransformer2DModel``), wired fused cond-first (HunyuanImage-3 style), standard combine.

Prompt rows are ``[cond_B; uncond_B]``; pooled rows are branch-independent (B rows, which the harness
broadcasts to both branches); ``img_ids`` / ``txt_ids`` are shared. Latents are ``[C, H, W]`` and
packed 2 x 2 for the forward; the model scales sigma by 1000 itself. A guidance-distilled checkpoint
(``guidance_embeds=True``, FLUX.1-dev) gets ``guidance`` as FluxPipeline passes it: the pipeline's
guidance_scale expanded to the batch, here a per-sample row field the harness tiles and broadcasts.
"""

from __future__ import annotations

import torch

from harness.replay import cfg as cfg_combines
from harness.replay.conditions import Conditions
from harness.replay.denoiser import FUSED_COND_FIRST
from harness.replay.families.base import ModelAdapter, check_cfg
from harness.replay.families.packing import pack_latents, unpack_latents

__all__ = ["EMBEDDED_GUIDANCE", "FLUX_TEXT_TOKENS", "FluxAdapter"]

FLUX_TEXT_TOKENS = 5
EMBEDDED_GUIDANCE = 3.5  # FluxPipeline's default guidance_scale for a guidance-distilled model


class FluxAdapter(ModelAdapter):
    cfg_layout = FUSED_COND_FIRST
    cfg_combine = cfg_combines.STANDARD
    channel_dim = 1

    def __init__(self, transformer: torch.nn.Module, latent_hw: int = 8):
        if latent_hw % 2:
            raise ValueError(f"Flux packs 2 x 2 latent patches; latent_hw must be even, got {latent_hw}")
        super().__init__(transformer)
        self.latent_hw = latent_hw

    @property
    def guidance_embeds(self) -> bool:
        return bool(getattr(self.module.config, "guidance_embeds", False))

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """[C, H, W] latents: the packed in_channels unpacked (/4) at ``latent_hw``."""
        return (self.module.config.in_channels // 4, self.latent_hw, self.latent_hw)

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        return sigma

    def forward(self, hidden: torch.Tensor, timestep: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        rows, shared, n = conditions.rows, conditions.shared, hidden.shape[0]
        self.require_rows(conditions, ("encoder_hidden_states", "pooled_projections"), n)
        guidance = None
        if self.guidance_embeds:
            if "guidance" not in rows:
                raise ValueError(f"{type(self).__name__}: this Flux checkpoint has guidance_embeds=True; its "
                                 "conditions need a 'guidance' row field (FluxPipeline's guidance_scale expanded "
                                 "to the batch)")
            self.require_rows(conditions, ("guidance",), n)
            guidance = rows["guidance"]
        out = self.module(pack_latents(hidden), encoder_hidden_states=rows["encoder_hidden_states"],
                          pooled_projections=rows["pooled_projections"], timestep=timestep, guidance=guidance,
                          img_ids=shared["img_ids"], txt_ids=shared["txt_ids"], return_dict=False)[0]
        return unpack_latents(out, tuple(hidden.shape[1:]))

    def example_conditions(self, batch: int, cfg: int, generator: torch.Generator,
                           guidance_scale: float = EMBEDDED_GUIDANCE) -> Conditions:
        """Seeded prompts (cfg=2: ``[cond; uncond]``), pooled rows, ids; ``guidance`` when distilled."""
        check_cfg(cfg)
        config = self.module.config
        _, h, w = self.latent_shape
        ys, xs = torch.meshgrid(torch.arange(h // 2), torch.arange(w // 2), indexing="ij")
        shared = {"img_ids": torch.stack([torch.zeros_like(ys), ys, xs], dim=-1).reshape(-1, 3).float(),
                  "txt_ids": torch.zeros(FLUX_TEXT_TOKENS, 3)}
        rows = {
            "encoder_hidden_states": torch.randn(cfg * batch, FLUX_TEXT_TOKENS, config.joint_attention_dim,
                                                 generator=generator),
            "pooled_projections": torch.randn(batch, config.pooled_projection_dim, generator=generator),
        }
        if self.guidance_embeds:
            rows["guidance"] = torch.full((batch,), float(guidance_scale), dtype=torch.float32)
        return Conditions(batch=batch, rows=rows, shared=shared, cfg_factor=cfg)
