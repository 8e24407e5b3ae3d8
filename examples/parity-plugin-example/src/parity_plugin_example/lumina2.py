"""A replay family whose pipeline post-processes the model output: diffusers' Lumina2, fused cond-first CFG.

The second worked family (``pixart.py`` is the first). Lumina2Pipeline differs from the pipelines the suite
ships in three ways a family author has to state, and each one is held to the real pipeline by the pipeline
oracle and ``cfg2.pipeline_combine``:

- ``timestep(sigma)``: Lumina2 counts time the other way round (t = 0 is noise): the pipeline passes
  ``1 - t / 1000`` with t = 1000 sigma;
- ``velocity(prediction, x, sigma)``: the pipeline negates the combined prediction before its scheduler steps
  (``noise_pred = -noise_pred``). Left out, every velocity is the exact negation of the pipeline's, which the
  oracle names a sign flip (relative error 2);
- ``cfg_combine`` / ``channel_dim``: with ``cfg_normalization`` (its default) the pipeline rescales the
  combined prediction to the cond prediction's norm over the LAST dim of its ``[N, C, H, W]`` latents, the
  latent width: ``TRUE_CFG_NORM_RESCALE`` over ``channel_dim = -1``.

Its two CFG branches run as two forwards in the pipeline; replay fuses them, cond rows first. The prompt rows
(caption embeddings and their padding masks) are per sample and per branch, so they are row fields: a per-row
value kept in ``Conditions.shared`` would be used unchanged for all S x cfg x B rows of a batched forward.
"""

from __future__ import annotations

import torch
from diffusers import Lumina2Transformer2DModel

from harness.replay.toolkit import (
    FUSED_COND_FIRST,
    TRUE_CFG_NORM_RESCALE,
    CheckpointKind,
    Conditions,
    ModelAdapter,
    PipelineSpec,
    ReplayFamily,
    flow_match_scheduler,
    fused_cond_first_conditions,
    padded_prompts,
)

__all__ = ["CHECKPOINT_KIND", "FAMILY", "PIPELINE", "Lumina2Adapter", "tiny_lumina2"]

TEXT_TOKENS = 6  # padded caption length: distinct lengths for both branches up to B = 3
CAPTION_CHANNELS = 16


def tiny_lumina2(seed: int = 0) -> Lumina2Transformer2DModel:
    """A random-init Lumina2 small enough for the CPU tier (one block, 8x8 latents), built from a config."""
    torch.manual_seed(seed)
    return Lumina2Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=1,
                                     num_refiner_layers=1, num_attention_heads=2, num_kv_heads=1, multiple_of=16,
                                     axes_dim_rope=(4, 6, 6), axes_lens=(32, 16, 16),
                                     cap_feat_dim=CAPTION_CHANNELS).eval()


class Lumina2Adapter(ModelAdapter):
    """Lumina2's calling convention: caption embeddings and their padding mask per row, cond rows first."""

    cfg_layout = FUSED_COND_FIRST
    cfg_combine = TRUE_CFG_NORM_RESCALE
    channel_dim = -1
    velocity_transform = "negated"

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """``1 - t / 1000`` for the pipeline's t = 1000 sigma (fp32, as the pipeline computes it)."""
        return 1.0 - (sigma.to(torch.float32) * 1000.0) / 1000.0

    def velocity(self, prediction: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """The pipeline steps its scheduler on the negated prediction."""
        return -prediction

    def forward(self, hidden: torch.Tensor, timestep: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        rows = conditions.rows
        self.require_rows(conditions, ("encoder_hidden_states", "encoder_attention_mask"), hidden.shape[0])
        self.require_patches(hidden, tuple(hidden.shape[-2:]), self.module.config.patch_size)
        return self.module(hidden, timestep=timestep, encoder_hidden_states=rows["encoder_hidden_states"],
                           encoder_attention_mask=rows["encoder_attention_mask"], return_dict=False)[0]

    def example_prompts(self, batch: int, cfg: int, generator: torch.Generator) -> dict:
        """Seeded caption embeddings with padding masks of distinct lengths (cfg=2: the negative ones too)."""
        return padded_prompts(batch, cfg, TEXT_TOKENS, CAPTION_CHANNELS, generator, "prompt_attention_mask")

    def conditions_from_prompts(self, prompts: dict, cfg: int) -> Conditions:
        """``[cond_B; uncond_B]`` rows of embeddings and masks (cfg=2), as replay fuses the pipeline's two calls."""
        return fused_cond_first_conditions(prompts, cfg, {"encoder_hidden_states": "prompt_embeds",
                                                          "encoder_attention_mask": "prompt_attention_mask"})


CHECKPOINT_KIND = CheckpointKind("lumina2_example", "replay", ("Lumina2Transformer2DModel",), "diffusers",
                                 family="lumina2_example")
PIPELINE = PipelineSpec("Lumina2Pipeline", flow_match_scheduler)
FAMILY = ReplayFamily("lumina2_example", Lumina2Adapter, CHECKPOINT_KIND, pipeline=PIPELINE,
                      tiny_model=tiny_lumina2)
