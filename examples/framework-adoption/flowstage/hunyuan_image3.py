"""HunyuanImage-3's image forward (``mode="gen_image"``): the runner hands it CFG-expanded ``[cond_B; uncond_B]``
sequences and the model splits its output at the midpoint, so S stacked steps tile branch-major outside and
step-major inside: ``[cond_s0, cond_s1, ..., uncond_s0, uncond_s1, ...]``.

The stage speaks the Instruct code's forward (``timesteps``, ``timesteps_index``, ``rope_image_info``). It replaces
the model's input check with one that raises a ValueError (upstream asserts, which ``python -O`` strips), on the
instance, through the static method upstream's forward calls.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from flowstage.diffusion import DiffusionStage
from flowstage.types import HunyuanImage3Conditions

__all__ = ["HunyuanImage3DiffusionStage"]

_PER_ROW = ("input_ids", "attention_mask", "image_mask", "timesteps_index", "cond_vae_image_mask",
            "cond_timesteps_index", "rope_image_info", "cond_vae_images")


def _checked(cond: bool, target: str, check_list: list[tuple[str, Any]]) -> None:
    """The stage's input check: upstream's rule, raised as a ValueError."""
    if cond:
        missing = [name for name, item in check_list if item is None]
        if missing:
            raise ValueError(f"HunyuanImage3DiffusionStage: {', '.join(missing)} must be given {target}")


def _repeat_rows(value: Any, repeats: int, branches: int) -> Any:
    """Each branch's rows as ``repeats`` whole blocks, branches kept apart: ``[c, c, ..., u, u, ...]``."""
    if isinstance(value, torch.Tensor):
        return torch.cat([group.repeat(repeats, *([1] * (value.dim() - 1))) for group in value.chunk(branches)])
    size = len(value) // branches
    return [row for b in range(branches) for row in list(value[b * size:(b + 1) * size]) * repeats]


class HunyuanImage3DiffusionStage(DiffusionStage):
    """HunyuanImage-3's stage: one fused forward of both CFG branches, the timestep ``1000 sigma``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model._check_inputs = _checked  # read as self._check_inputs(...) by upstream's forward

    def _prepare_generation(self, image_mask: torch.Tensor) -> None:
        """What upstream's generate sets before its loop: the forward reads them (one timestep token)."""
        image_rows = image_mask[0].nonzero().flatten()
        self.model.num_special_tokens = 1
        self.model.num_image_tokens = int(image_rows.numel())
        self.model.post_token_len = int(image_mask.shape[1] - 1 - int(image_rows[-1]))

    def predict_noise(self, sample: torch.Tensor, sigma: torch.Tensor, conditions: HunyuanImage3Conditions, *,
                      guidance_scale: float) -> torch.Tensor:
        rows = conditions.rows
        timestep = (torch.as_tensor(sigma, dtype=torch.float32) * 1000.0).expand(sample.shape[0])
        branches = 2 if conditions.cfg_expanded else 1
        images, timesteps = torch.cat([sample] * branches), torch.cat([timestep] * branches)
        if images.shape[0] != rows:
            raise ValueError(f"HunyuanImage3DiffusionStage: {images.shape[0]} latent rows for {rows} sequences")
        self._prepare_generation(conditions.image_mask)
        out = self.model(
            input_ids=conditions.input_ids, attention_mask=conditions.attention_mask,
            position_ids=conditions.position_ids.reshape(1, -1).expand(rows, -1), past_key_values=None,
            use_cache=False, mode="gen_image", first_step=True, images=images, image_mask=conditions.image_mask,
            timesteps=timesteps, timesteps_index=conditions.timesteps_index,
            gen_timestep_scatter_index=conditions.timesteps_index, rope_image_info=list(conditions.rope_image_info),
            cond_vae_images=list(conditions.cond_vae_images), cond_vae_image_mask=conditions.cond_vae_image_mask,
            cond_timesteps=torch.zeros(rows, len(conditions.cond_vae_images[0])),
            cond_timesteps_index=conditions.cond_timesteps_index)["diffusion_prediction"]
        if branches == 1:
            return out
        cond, uncond = out.chunk(2, dim=0)
        return uncond + guidance_scale * (cond - uncond)

    def _tile_conditions(self, conditions: HunyuanImage3Conditions, repeats: int) -> HunyuanImage3Conditions:
        branches = 2 if conditions.cfg_expanded else 1
        return dataclasses.replace(conditions, **{name: _repeat_rows(getattr(conditions, name), repeats, branches)
                                                  for name in _PER_ROW})
