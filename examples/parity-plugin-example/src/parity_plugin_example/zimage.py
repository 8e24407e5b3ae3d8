"""A replay family whose transformer takes and returns Python lists: diffusers' Z-Image, fused cond-first CFG.

The third worked family (``pixart.py`` and ``lumina2.py`` are the others). ``ZImageTransformer2DModel`` takes one
latent per sample (a list of ``[C, 1, H, W]`` tensors), one caption per sample with no mask (a list of
``[tokens, channels]`` tensors whose lengths differ: the text encoder's padding is cut off before the model sees
it) and returns a list of per-sample predictions. ZImagePipeline differs from the pipelines the suite ships in
four ways a family author has to state, and each is held to the real pipeline by the pipeline oracle and
``cfg2.pipeline_combine``:

- list-valued I/O: the adapter's ``forward`` keeps replay's ``[N, C, H, W]`` latents and hands the model the
  list the pipeline hands it; ``from_pipeline_latents`` turns the model's list back into one tensor (the oracle
  hands it the model's outputs as well as the pipeline's latents). The captions are a row field holding a list:
  the harness tiles and broadcasts a list field row by row as it does a tensor's rows, so a caption's length
  travels with its row (a per-row length kept under ``Conditions.shared`` would not: it is the same for every
  row of a batched forward);
- ``timestep(sigma)``: Z-Image counts time the other way round; the pipeline passes ``(1000 - t) / 1000`` with
  t = 1000 sigma (0 at pure noise);
- ``cfg_combine``: the pipeline anchors its combine on the cond branch, ``pos + g (pos - neg)``: declared as that
  formula (``COND_ANCHORED``), not as the standard ``uncond + g (cond - uncond)``;
- ``velocity``: the pipeline steps its scheduler on the negated prediction (``noise_pred = -noise_pred``).

Its CFG batch is ``prompt_embeds + negative_prompt_embeds`` in one forward: cond rows first, fused cond-first.
The config has no ``sample_size`` (the pipeline takes the image size from the call), so the family states the
latent size it is judged at.
"""

from __future__ import annotations

import functools

import torch
from diffusers import ZImageTransformer2DModel

from harness.replay.toolkit import (
    COND_ANCHORED,
    FUSED_COND_FIRST,
    CheckpointKind,
    Conditions,
    ModelAdapter,
    PipelineSpec,
    Prompts,
    ReplayFamily,
    flow_match_scheduler,
    fused_cond_first_conditions,
    ragged_prompts,
)

__all__ = ["CHECKPOINT_KIND", "FAMILY", "PIPELINE", "ZImageAdapter", "tiny_zimage"]

TEXT_TOKENS = 6  # the longest caption of the example prompts: distinct lengths for both branches up to B = 3
CAPTION_CHANNELS = 16
LATENT_HW = 8  # the latent grid the family is judged at (64 x 64 pixels through the pipeline's VAE factor 8)
PATCH = 2  # ZImagePipeline calls the transformer at its default patch size


def tiny_zimage(seed: int = 0) -> ZImageTransformer2DModel:
    """A random-init Z-Image small enough for the CPU tier (one block and one refiner each), built from a config."""
    torch.manual_seed(seed)
    return ZImageTransformer2DModel(all_patch_size=(PATCH,), all_f_patch_size=(1,), in_channels=4, dim=32,
                                    n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
                                    cap_feat_dim=CAPTION_CHANNELS, axes_dims=[4, 6, 6], axes_lens=[64, 16, 16]).eval()


class ZImageAdapter(ModelAdapter):
    """Z-Image's calling convention: a list of latents and a list of ragged captions, cond rows first."""

    cfg_layout = FUSED_COND_FIRST
    cfg_combine = COND_ANCHORED
    velocity_transform = "negated"

    def __init__(self, transformer: torch.nn.Module, latent_hw: int = LATENT_HW):
        super().__init__(transformer)
        self.latent_hw = latent_hw

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """``[C, H, W]``: the layout ZImagePipeline steps its scheduler on (the model sees ``[C, 1, H, W]``)."""
        return (self.module.config.in_channels, self.latent_hw, self.latent_hw)

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """``(1000 - t) / 1000`` for the pipeline's t = 1000 sigma, in fp32 as the pipeline computes it."""
        return (1000.0 - sigma.to(torch.float32) * 1000.0) / 1000.0

    def velocity(self, prediction: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """The pipeline steps its scheduler on the negated prediction."""
        return -prediction

    def from_pipeline_latents(self, latents: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        """The pipeline's ``[B, C, H, W]`` latents as they are; the model's list of ``[C, 1, H, W]`` predictions
        stacked and their frame dim dropped, as the pipeline does before its combine's result is stepped."""
        if isinstance(latents, torch.Tensor):
            return latents
        return torch.stack(list(latents)).squeeze(2)

    def forward(self, hidden: torch.Tensor, timestep: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        self.require_rows(conditions, ("cap_feats",), hidden.shape[0])
        self.require_patches(hidden, tuple(hidden.shape[-2:]), PATCH)
        latents = list(hidden.unsqueeze(2).unbind(dim=0))  # one [C, 1, H, W] latent per row, as the pipeline
        out = self.module(latents, timestep, list(conditions.rows["cap_feats"]), return_dict=False)[0]
        return self.from_pipeline_latents(out)

    def example_prompts(self, batch: int, cfg: int, generator: torch.Generator) -> Prompts:
        """Seeded captions of different lengths, one tensor per sample and no mask, as the pipeline's text encoder
        leaves them (cfg=2: the negative ones too)."""
        return ragged_prompts(batch, cfg, TEXT_TOKENS, self.module.config.cap_feat_dim, generator)

    def conditions_from_prompts(self, prompts: Prompts, cfg: int) -> Conditions:
        """``[cond_B; uncond_B]`` captions in one list (cfg=2), as the pipeline concatenates its two lists."""
        return fused_cond_first_conditions(prompts, cfg, {"cap_feats": "prompt_embeds"})


CHECKPOINT_KIND = CheckpointKind("zimage_example", "replay", ("ZImageTransformer2DModel",), "diffusers",
                                 family="zimage_example")
# the scheduler of the released Z-Image-Turbo: flow-matching Euler at shift 3, no resolution-dependent shift
PIPELINE = PipelineSpec("ZImagePipeline", functools.partial(flow_match_scheduler, shift=3.0), prompt_arg="cap_feats",
                        timestep_arg="t")
FAMILY = ReplayFamily("zimage_example", ZImageAdapter, CHECKPOINT_KIND, pipeline=PIPELINE, tiny_model=tiny_zimage)
