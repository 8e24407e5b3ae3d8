"""Flux (``diffusers.FluxTransformer2DModel``), wired fused cond-first (HunyuanImage-3 style), standard combine.

FluxPipeline's true CFG runs the prompt's forward, then the negative prompt's, and combines
``neg + true_cfg_scale (cond - neg)``; replay fuses them into one forward ``[cond_B; uncond_B]``. A pooled
embedding the two branches share is one B-row field the harness broadcasts to both branches; a
negative pooled embedding of its own makes it a 2B-row field. ``img_ids`` / ``txt_ids`` are shared.
Latents are ``[C, H, W]``, packed 2 x 2 for the forward; the model scales its timestep (sigma) by 1000
itself. A guidance-distilled checkpoint (``guidance_embeds=True``, FLUX.1-dev) gets ``guidance`` as
FluxPipeline passes it: one ``guidance_scale`` for the whole call, expanded to the forward's rows.
"""

from __future__ import annotations

import torch

from harness.replay import cfg as cfg_combines
from harness.replay.conditions import Conditions
from harness.replay.denoiser import FUSED_COND_FIRST
from harness.replay.families.base import ModelAdapter, Prompts, check_cfg
from harness.replay.families.packing import pack_latents, unpack_latents

__all__ = ["EMBEDDED_GUIDANCE", "FLUX_TEXT_TOKENS", "FluxAdapter"]

FLUX_TEXT_TOKENS = 5
EMBEDDED_GUIDANCE = 3.5  # FluxPipeline's default guidance_scale for a guidance-distilled model


class FluxAdapter(ModelAdapter):
    cfg_layout = FUSED_COND_FIRST
    cfg_combine = cfg_combines.STANDARD

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

    @property
    def latent_size(self) -> tuple[int, int]:
        return (self.latent_hw, self.latent_hw)

    def to_pipeline_latents(self, x: torch.Tensor) -> torch.Tensor:
        return pack_latents(x)

    def from_pipeline_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return unpack_latents(latents, self.latent_shape)

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        return sigma

    def forward(self, hidden: torch.Tensor, timestep: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        rows, shared, n = conditions.rows, conditions.shared, hidden.shape[0]
        self.require_rows(conditions, ("encoder_hidden_states", "pooled_projections"), n)
        self.require_shared(conditions, ("img_ids", "txt_ids"))
        guidance = None
        if self.guidance_embeds:
            if "guidance" not in shared:
                raise ValueError(f"{type(self).__name__}: this Flux checkpoint has guidance_embeds=True; its "
                                 "conditions need a shared 'guidance' field (FluxPipeline's guidance_scale, which "
                                 "it expands to the batch)")
            guidance = shared["guidance"].to(torch.float32).expand(n)
        out = self.module(pack_latents(hidden), encoder_hidden_states=rows["encoder_hidden_states"],
                          pooled_projections=rows["pooled_projections"], timestep=timestep, guidance=guidance,
                          img_ids=shared["img_ids"], txt_ids=shared["txt_ids"], return_dict=False)[0]
        return unpack_latents(out, tuple(hidden.shape[1:]))

    def example_prompts(self, batch: int, cfg: int, generator: torch.Generator,
                        guidance_scale: float = EMBEDDED_GUIDANCE) -> Prompts:
        """Seeded prompt (cfg=2: and negative prompt) embeddings; one pooled embedding both branches use;
        the embedded ``guidance_scale`` when the checkpoint is guidance-distilled."""
        check_cfg(cfg)
        config = self.module.config
        embeds = torch.randn(cfg * batch, FLUX_TEXT_TOKENS, config.joint_attention_dim, generator=generator)
        pooled = torch.randn(batch, config.pooled_projection_dim, generator=generator)
        prompts: Prompts = {"prompt_embeds": embeds[:batch], "pooled_prompt_embeds": pooled}
        if cfg == 2:
            prompts.update(negative_prompt_embeds=embeds[batch:], negative_pooled_prompt_embeds=pooled)
        if self.guidance_embeds:
            prompts["guidance_scale"] = float(guidance_scale)
        return prompts

    def conditions_from_prompts(self, prompts: Prompts, cfg: int) -> Conditions:
        """``[prompt; negative]`` rows (cfg=2); the pooled rows once when both branches share them; shared
        ids and the embedded guidance."""
        check_cfg(cfg)
        embeds, pooled = prompts["prompt_embeds"], prompts["pooled_prompt_embeds"]
        batch, tokens = embeds.shape[0], embeds.shape[1]
        if cfg == 2:
            embeds = torch.cat([embeds, prompts["negative_prompt_embeds"]])
            negative_pooled = prompts["negative_pooled_prompt_embeds"]
            if not torch.equal(negative_pooled, pooled):
                pooled = torch.cat([pooled, negative_pooled])
        h, w = self.latent_size
        ys, xs = torch.meshgrid(torch.arange(h // 2), torch.arange(w // 2), indexing="ij")
        shared = {"img_ids": torch.stack([torch.zeros_like(ys), ys, xs], dim=-1).reshape(-1, 3).float(),
                  "txt_ids": torch.zeros(tokens, 3)}
        if self.guidance_embeds:
            shared["guidance"] = torch.tensor(float(prompts.get("guidance_scale", EMBEDDED_GUIDANCE)))
        return Conditions(batch=batch, rows={"encoder_hidden_states": embeds, "pooled_projections": pooled},
                          shared=shared, cfg_factor=cfg)
