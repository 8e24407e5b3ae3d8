"""Qwen-Image (``diffusers.QwenImageTransformer2DModel``): uncond-first, true-CFG with norm rescale.

As QwenImagePipeline runs it: latents stay packed ``[L, 4C]`` (L = (H/2)(W/2) tokens) through the
whole loop, the model gets ``timestep = sigma``, padded prompt embeddings with
``encoder_hidden_states_mask`` (1 = real token; rows have unequal lengths) and ``img_shapes``, one
``[(frames, H/2, W/2)]`` entry per sample. The pipeline runs its two branches as two forwards and
combines ``comb * ||cond|| / ||comb||`` over the last (channel) dim of the packed latents; replay
fuses the branches into one forward ``[uncond; cond]``, so both branches' prompts are padded to one
length with their masks kept.
"""

from __future__ import annotations

import torch

from harness.replay import cfg as cfg_combines
from harness.replay.conditions import Conditions
from harness.replay.denoiser import UNCOND_FIRST
from harness.replay.families.base import ModelAdapter, check_cfg

__all__ = ["QWEN_TEXT_TOKENS", "QwenImageAdapter", "text_lengths"]

QWEN_TEXT_TOKENS = 6  # padded prompt length of the example conditions
ROW_FIELDS = ("encoder_hidden_states", "encoder_hidden_states_mask", "img_shapes")


def text_lengths(batch: int, tokens: int, generator: torch.Generator) -> list[int]:
    """Seeded real-token counts in [2, tokens], unequal where the batch allows (row 0 is full)."""
    drawn = torch.randint(2, tokens + 1, (batch,), generator=generator).tolist()
    drawn[0] = tokens
    if batch > 1 and len(set(drawn)) == 1:
        drawn[-1] = 2
    return [int(n) for n in drawn]


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
    def img_shape(self) -> list[tuple[int, int, int]]:
        """One sample's ``img_shapes`` entry: one image of (1 frame, H/2, W/2) patches."""
        return [(1, self.latent_hw // 2, self.latent_hw // 2)]

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        return sigma

    def forward(self, hidden: torch.Tensor, timestep: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        rows = conditions.rows
        self.require_rows(conditions, ROW_FIELDS, hidden.shape[0])
        return self.module(hidden_states=hidden, encoder_hidden_states=rows["encoder_hidden_states"],
                           encoder_hidden_states_mask=rows["encoder_hidden_states_mask"], timestep=timestep,
                           img_shapes=list(rows["img_shapes"]), return_dict=False)[0]

    def example_conditions(self, batch: int, cfg: int, generator: torch.Generator) -> Conditions:
        """Seeded padded prompts with unequal masks per row and per branch; cfg=2 adds ``negative``."""
        check_cfg(cfg)
        joint_dim = self.module.config.joint_attention_dim

        def branch() -> Conditions:
            lengths = text_lengths(batch, QWEN_TEXT_TOKENS, generator)
            mask = (torch.arange(QWEN_TEXT_TOKENS)[None, :] < torch.tensor(lengths)[:, None]).long()
            embeds = torch.randn(batch, QWEN_TEXT_TOKENS, joint_dim, generator=generator) * mask[..., None]
            return Conditions(batch=batch, rows={"encoder_hidden_states": embeds, "encoder_hidden_states_mask": mask,
                                                 "img_shapes": [self.img_shape for _ in range(batch)]})

        cond = branch()
        return Conditions(batch=batch, rows=cond.rows, negative=branch()) if cfg == 2 else cond
