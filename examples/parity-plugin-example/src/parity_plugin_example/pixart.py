"""A replay family the suite does not ship: diffusers' PixArt-alpha transformer, uncond-first CFG.

This module is the reference for the replay adapter contract (``docs/extending.md``). A family is
``harness.replay.families.ReplayFamily``: an adapter class, the checkpoint kind that recognises a saved
PixArt, the diffusers pipeline it is tied to and a tiny random-init model for the CPU catalogue. The
adapter (``ModelAdapter``) does four things and the harness does the rest (tiling the S target steps,
the CFG batch, broadcasting per-sample fields, the SDE step):

- ``forward(hidden, timestep, conditions)``: exactly one transformer call over the N rows it is given.
  Every row field it receives already has N rows (``require_rows`` refuses anything else: an adapter
  never repeats rows); latents that do not fit the patch size are refused before the model runs.
- ``timestep(sigma)``: per-row sigma to the model's timestep in the units its pipeline passes. PixArt's
  pipeline runs a DPM-Solver scheduler on flow sigmas, whose timesteps are integers: ``trunc(1000 sigma)``.
- ``cfg_layout`` / ``cfg_combine`` / ``channel_dim``: PixArtAlphaPipeline batches ``[negative; prompt]``
  (uncond-first) and combines ``uncond + g (cond - uncond)`` (standard); channel_dim is dim 1 of
  ``[N, C, H, W]`` latents (a norm-rescaling combine would reduce over it).
- ``example_prompts`` / ``conditions_from_prompts``: seeded encoded prompts under the pipeline's own
  argument names, and their translation into replay rows. Row fields are per sample (one row per sample
  and branch: the caption embeddings and their padding mask); a value every row of a call shares would
  go under ``Conditions.shared``. The harness refuses example conditions whose row fields repeat a row
  within or across branches, so the mask lengths are drawn distinct.
"""

from __future__ import annotations

import torch
from diffusers import PixArtTransformer2DModel

from harness.replay.toolkit import (
    STANDARD,
    UNCOND_FIRST,
    CheckpointKind,
    Conditions,
    ModelAdapter,
    PipelineSpec,
    ReplayFamily,
    padded_prompts,
    uncond_first_conditions,
)

__all__ = ["CHECKPOINT_KIND", "FAMILY", "PIPELINE", "PixArtAdapter", "tiny_pixart"]

TEXT_TOKENS = 6  # padded caption length: distinct lengths for both branches up to B = 3


def tiny_pixart(seed: int = 0) -> PixArtTransformer2DModel:
    """A random-init PixArt small enough for the CPU tier (one block, 8x8 latents), built from a config."""
    torch.manual_seed(seed)
    return PixArtTransformer2DModel(sample_size=8, num_layers=1, attention_head_dim=8, num_attention_heads=2,
                                    in_channels=4, out_channels=4, patch_size=2, cross_attention_dim=16,
                                    caption_channels=12, norm_type="ada_norm_single",
                                    use_additional_conditions=False).eval()


class PixArtAdapter(ModelAdapter):
    """PixArt's calling convention: caption embeddings and their padding mask per row, uncond-first CFG."""

    cfg_layout = UNCOND_FIRST
    cfg_combine = STANDARD
    channel_dim = 1

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        return torch.trunc(sigma.double() * 1000.0).to(torch.float32)

    def forward(self, hidden: torch.Tensor, timestep: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        rows = conditions.rows
        self.require_rows(conditions, ("encoder_hidden_states", "encoder_attention_mask"), hidden.shape[0])
        self.require_patches(hidden, tuple(hidden.shape[-2:]), self.module.config.patch_size)
        return self.module(hidden, encoder_hidden_states=rows["encoder_hidden_states"],
                           encoder_attention_mask=rows["encoder_attention_mask"], timestep=timestep,
                           added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False)[0]

    def example_prompts(self, batch: int, cfg: int, generator: torch.Generator) -> dict:
        """Seeded caption embeddings with padding masks of distinct lengths (cfg=2: the negative ones too)."""
        return padded_prompts(batch, cfg, TEXT_TOKENS, self.module.config.caption_channels, generator,
                              "prompt_attention_mask")

    def conditions_from_prompts(self, prompts: dict, cfg: int) -> Conditions:
        """Each branch's embeddings and mask as its rows; cfg=2 puts the negative branch under ``negative``."""
        return uncond_first_conditions(prompts, cfg, {"encoder_hidden_states": "prompt_embeds",
                                                      "encoder_attention_mask": "prompt_attention_mask"})


def _scheduler():
    """DPM-Solver on flow sigmas (shift 3), a scheduler PixArt's pipeline runs: integer timesteps."""
    from diffusers import DPMSolverMultistepScheduler

    return DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction")


CHECKPOINT_KIND = CheckpointKind("pixart_example", "replay", ("PixArtTransformer2DModel",), "diffusers",
                                 family="pixart_example")
PIPELINE = PipelineSpec("PixArtAlphaPipeline", _scheduler,
                        call_kwargs={"negative_prompt": None, "use_resolution_binning": False})
FAMILY = ReplayFamily("pixart_example", PixArtAdapter, CHECKPOINT_KIND, pipeline=PIPELINE, tiny_model=tiny_pixart)
