"""CogView4 (``diffusers.CogView4Transformer2DModel``): fused cond-first CFG, standard combine.

CogView4Pipeline runs the prompt's forward, then the negative prompt's, and combines
``uncond + g (cond - uncond)``; replay fuses them into one forward ``[cond_B; uncond_B]``. Its
timestep is NOT ``sigma * 1000``: the pipeline passes its scheduler's unshifted timesteps (an integer
grid from 1000 down) while the scheduler steps on sigmas shifted by the resolution-dependent linear
time shift ``sigma = mu / (mu + 1/s - 1)`` with ``s = t / 1000`` and ``mu = 0.75 sqrt(L / 256) + 0.25``
(L = latent tokens). The timestep hook inverts that shift, so a replay that steps on sigma feeds the
model the pipeline's own t. The image-size conditioning (``original_size``, ``target_size``,
``crop_coords``: one value per call, in pixels) is shared and expanded to the forward's rows.
Latents are ``[C, H, W]``; the model patches them itself.
"""

from __future__ import annotations

import torch

from harness.replay import cfg as cfg_combines
from harness.replay.conditions import Conditions
from harness.replay.denoiser import FUSED_COND_FIRST
from harness.replay.families.base import ModelAdapter, Prompts, check_cfg

__all__ = ["COGVIEW4_TEXT_TOKENS", "VAE_SCALE", "CogView4Adapter", "time_shift_mu"]

COGVIEW4_TEXT_TOKENS = 5
VAE_SCALE = 8  # CogView4's VAE downsamples 8x (and its pipeline assumes 8 without one)
BASE_SEQ_LEN, BASE_SHIFT, MAX_SHIFT = 256, 0.25, 0.75  # the pipeline's scheduler config
SIZE_FIELDS = ("original_size", "target_size", "crop_coords")


def time_shift_mu(image_seq_len: int) -> float:
    """CogView4Pipeline's resolution-dependent shift: ``0.75 sqrt(L / 256) + 0.25``."""
    return (image_seq_len / BASE_SEQ_LEN) ** 0.5 * MAX_SHIFT + BASE_SHIFT


class CogView4Adapter(ModelAdapter):
    cfg_layout = FUSED_COND_FIRST
    cfg_combine = cfg_combines.STANDARD

    @property
    def mu(self) -> float:
        h, w = self.latent_size
        return time_shift_mu(h * w // self.module.config.patch_size ** 2)

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """t = 1000 s for the unshifted s of ``sigma``: s = sigma / (sigma + mu (1 - sigma))."""
        s = sigma.double()
        return (1000.0 * s / (s + self.mu * (1.0 - s))).to(sigma.dtype)

    def forward(self, hidden: torch.Tensor, timestep: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        n, shared = hidden.shape[0], conditions.shared
        self.require_rows(conditions, ("encoder_hidden_states",), n)
        self.require_shared(conditions, SIZE_FIELDS)
        self.require_patches(hidden, tuple(hidden.shape[-2:]), self.module.config.patch_size)
        sizes = {name: shared[name].to(torch.float32).reshape(1, 2).expand(n, 2) for name in SIZE_FIELDS}
        return self.module(hidden_states=hidden, encoder_hidden_states=conditions.rows["encoder_hidden_states"],
                           timestep=timestep, return_dict=False, **sizes)[0]

    def example_prompts(self, batch: int, cfg: int, generator: torch.Generator) -> Prompts:
        """Seeded GLM prompt embeddings (cfg=2: and the negative prompt's, of the same length) and the
        image-size conditioning the pipeline defaults to."""
        check_cfg(cfg)
        dim = self.module.config.text_embed_dim
        embeds = torch.randn(cfg * batch, COGVIEW4_TEXT_TOKENS, dim, generator=generator)
        h, w = self.latent_size
        prompts: Prompts = {"prompt_embeds": embeds[:batch], "original_size": (h * VAE_SCALE, w * VAE_SCALE),
                            "crops_coords_top_left": (0, 0)}
        if cfg == 2:
            prompts["negative_prompt_embeds"] = embeds[batch:]
        return prompts

    def conditions_from_prompts(self, prompts: Prompts, cfg: int) -> Conditions:
        """``[prompt; negative]`` rows (cfg=2) and the size conditioning as shared fields."""
        check_cfg(cfg)
        embeds = prompts["prompt_embeds"]
        batch = embeds.shape[0]
        if cfg == 2:
            embeds = torch.cat([embeds, prompts["negative_prompt_embeds"]])
        h, w = self.latent_size
        shared = {"original_size": torch.tensor(prompts.get("original_size", (h * VAE_SCALE, w * VAE_SCALE)),
                                                dtype=torch.float32),
                  "target_size": torch.tensor((h * VAE_SCALE, w * VAE_SCALE), dtype=torch.float32),
                  "crop_coords": torch.tensor(prompts.get("crops_coords_top_left", (0, 0)), dtype=torch.float32)}
        return Conditions(batch=batch, rows={"encoder_hidden_states": embeds}, shared=shared, cfg_factor=cfg)
