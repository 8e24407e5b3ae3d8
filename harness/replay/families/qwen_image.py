"""Qwen-Image (``diffusers.QwenImageTransformer2DModel``): uncond-first, true-CFG with norm rescale.

As QwenImagePipeline runs it: latents stay packed ``[L, 4C]`` (L = (H/2)(W/2) tokens) through the
whole loop, the model gets ``timestep = sigma``, padded prompt embeddings with
``encoder_hidden_states_mask`` (1 = real token; rows have unequal lengths) and ``img_shapes``, one
``[(frames, H/2, W/2)]`` entry per sample: every sample of a call has the same image shape, so it is a
shared field the adapter expands to the forward's rows. The pipeline runs its two branches as two
forwards and combines ``comb * ||cond|| / ||comb||`` over the last (channel) dim of the packed latents;
replay fuses the branches into one forward ``[uncond; cond]``, so both branches' prompts are padded to
one length with their masks kept.
"""

from __future__ import annotations

import torch

from harness.replay import cfg as cfg_combines
from harness.replay.conditions import Conditions
from harness.replay.denoiser import UNCOND_FIRST
from harness.replay.families.base import ModelAdapter, Prompts, padded_prompts, uncond_first_conditions

__all__ = ["QWEN_TEXT_TOKENS", "QwenImageAdapter"]

QWEN_TEXT_TOKENS = 6  # padded prompt length of the example conditions
ROW_FIELDS = ("encoder_hidden_states", "encoder_hidden_states_mask")


class QwenImageAdapter(ModelAdapter):
    cfg_layout = UNCOND_FIRST
    cfg_combine = cfg_combines.TRUE_CFG_NORM_RESCALE
    channel_dim = -1

    def __init__(self, transformer: torch.nn.Module, latent_hw: int = 8):
        if latent_hw % 2:
            raise ValueError(f"Qwen-Image packs 2 x 2 latent patches; latent_hw must be even, got {latent_hw}")
        super().__init__(transformer)
        self.latent_hw = latent_hw

    @property
    def latent_shape(self) -> tuple[int, int]:
        """Packed ``[L, 4C]`` latents, the layout the pipeline steps its scheduler on."""
        return ((self.latent_hw // 2) ** 2, self.module.config.in_channels)

    @property
    def latent_size(self) -> tuple[int, int]:
        return (self.latent_hw, self.latent_hw)

    @property
    def img_shape(self) -> list[tuple[int, int, int]]:
        """One sample's ``img_shapes`` entry: one image of (1 frame, H/2, W/2) patches."""
        return [(1, self.latent_hw // 2, self.latent_hw // 2)]

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        return sigma

    def forward(self, hidden: torch.Tensor, timestep: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        rows, n = conditions.rows, hidden.shape[0]
        self.require_rows(conditions, ROW_FIELDS, n)
        self.require_shared(conditions, ("img_shape",))
        if tuple(hidden.shape[1:]) != self.latent_shape:
            raise ValueError(f"{type(self).__name__}: packed latents of shape {tuple(hidden.shape)} do not fit "
                             f"{self.latent_hw} x {self.latent_hw} latents in 2 x 2 patches: expected "
                             f"[N, {self.latent_shape[0]}, {self.latent_shape[1]}]")
        img_shapes = [list(conditions.shared["img_shape"]) for _ in range(n)]
        return self.module(hidden_states=hidden, encoder_hidden_states=rows["encoder_hidden_states"],
                           encoder_hidden_states_mask=rows["encoder_hidden_states_mask"], timestep=timestep,
                           img_shapes=img_shapes, return_dict=False)[0]

    def example_prompts(self, batch: int, cfg: int, generator: torch.Generator) -> Prompts:
        """Seeded padded prompts whose real lengths differ per row and per branch (cfg=2: negatives too)."""
        return padded_prompts(batch, cfg, QWEN_TEXT_TOKENS, self.module.config.joint_attention_dim, generator,
                              "prompt_embeds_mask", zero_padding=True)

    def conditions_from_prompts(self, prompts: Prompts, cfg: int) -> Conditions:
        """Each branch's embeddings and mask as its rows (cfg=2: the negative branch under ``negative``)."""
        return uncond_first_conditions(prompts, cfg, {"encoder_hidden_states": "prompt_embeds",
                                                      "encoder_hidden_states_mask": "prompt_embeds_mask"},
                                       shared={"img_shape": tuple(self.img_shape)})
