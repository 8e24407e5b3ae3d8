"""A replay family the suite does not ship: diffusers' PixArt-alpha transformer, uncond-first CFG.

The adapter translates replay rows into one PixArt forward; the harness does the rest (tiling the
S target steps, the CFG batch, the SDE step). PixArt's pipeline batches ``[uncond; cond]`` and
passes a prompt attention mask, so the family is uncond-first with a padded ``encoder_attention_mask``.

A family is ``harness.replay.families.ReplayFamily``: an adapter class (``ModelAdapter``: CFG layout and
CFG combine, latent shape, seeded example conditions) and the checkpoint kind that recognises a saved
PixArt. The harness spreads per-sample fields to the forward's row count; the adapter only checks them.
"""

from __future__ import annotations

import torch
from diffusers import PixArtTransformer2DModel

from harness.plugins import CheckpointKind
from harness.replay import cfg as cfg_combines
from harness.replay.conditions import Conditions
from harness.replay.denoiser import UNCOND_FIRST
from harness.replay.families import ModelAdapter, ReplayFamily

__all__ = ["CHECKPOINT_KIND", "FAMILY", "PixArtAdapter", "tiny_pixart"]

TEXT_TOKENS = 6


def tiny_pixart(seed: int = 0) -> PixArtTransformer2DModel:
    """A random-init PixArt small enough for the CPU tier (one block, 8x8 latents)."""
    torch.manual_seed(seed)
    return PixArtTransformer2DModel(sample_size=8, num_layers=1, attention_head_dim=8, num_attention_heads=2,
                                    in_channels=4, out_channels=4, patch_size=2, cross_attention_dim=16,
                                    caption_channels=12, norm_type="ada_norm_single",
                                    use_additional_conditions=False).eval()


class PixArtAdapter(ModelAdapter):
    """PixArt's calling convention: caption embeddings and their padding mask per row, uncond-first CFG."""

    cfg_layout = UNCOND_FIRST
    cfg_combine = cfg_combines.STANDARD
    channel_dim = 1

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        config = self.module.config
        return (config.in_channels, config.sample_size, config.sample_size)

    def forward(self, hidden: torch.Tensor, timestep: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        rows = conditions.rows
        self.require_rows(conditions, ("encoder_hidden_states", "encoder_attention_mask"), hidden.shape[0])
        return self.module(hidden, encoder_hidden_states=rows["encoder_hidden_states"],
                           encoder_attention_mask=rows["encoder_attention_mask"], timestep=timestep,
                           added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False)[0]

    def example_conditions(self, batch: int, cfg: int, generator: torch.Generator) -> Conditions:
        """Seeded caption embeddings with unequal padded lengths; cfg=2 adds the uncond branch as ``negative``."""
        channels = self.module.config.caption_channels

        def branch() -> Conditions:
            lengths = torch.randint(2, TEXT_TOKENS + 1, (batch,), generator=generator)
            mask = (torch.arange(TEXT_TOKENS)[None, :] < lengths[:, None]).long()
            return Conditions(batch=batch, rows={
                "encoder_hidden_states": torch.randn(batch, TEXT_TOKENS, channels, generator=generator),
                "encoder_attention_mask": mask})

        cond = branch()
        return Conditions(batch=batch, rows=cond.rows, negative=branch()) if cfg == 2 else cond


CHECKPOINT_KIND = CheckpointKind("pixart_example", "replay", ("PixArtTransformer2DModel",), "diffusers",
                                 family="pixart_example")
FAMILY = ReplayFamily("pixart_example", PixArtAdapter, CHECKPOINT_KIND)
