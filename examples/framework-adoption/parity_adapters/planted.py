"""Two bugs such frameworks have shipped, planted in flowstage's own stages: the suite must fail each, naming it."""

from __future__ import annotations

import torch
from flowstage.hunyuan_ar import HunyuanImage3ARStage
from flowstage.hunyuan_image3 import HunyuanImage3DiffusionStage

from harness.plugins.declarations import ARDeclaration
from parity_adapters.ar import rollout_with
from parity_adapters.replay import hunyuan_image3_conditions, hunyuan_image3_replay, replay_with


class StepMajorOuterStage(HunyuanImage3DiffusionStage):
    """Tiles the fused ``[cond_B; uncond_B]`` batch S times as a whole: ``[c, u, c, u, ...]``, step-major outside."""

    def _tile_conditions(self, conditions, repeats):
        import dataclasses

        def whole(value):
            return value.repeat(repeats, *([1] * (value.dim() - 1))) if isinstance(value, torch.Tensor) \
                else list(value) * repeats
        return dataclasses.replace(conditions, **{name: whole(getattr(conditions, name)) for name in (
            "input_ids", "attention_mask", "image_mask", "timesteps_index", "cond_vae_image_mask",
            "cond_timesteps_index", "rope_image_info", "cond_vae_images")})


class DynamicCacheStage(HunyuanImage3ARStage):
    """Keeps generate's dynamic cache at every batch size."""

    def _cache(self, rows, slots):
        return self.cache_cls(config=self.model.config, max_batch_size=rows, max_cache_len=slots,
                              dtype=self.model.dtype, dynamic=True)


cfg_tiling_step_major_outer = replay_with(StepMajorOuterStage, hunyuan_image3_conditions)
cfg_tiling_step_major_outer.declares = hunyuan_image3_replay.declares
dynamic_cache_at_any_batch = rollout_with(DynamicCacheStage)
dynamic_cache_at_any_batch.declares = ARDeclaration(models=("fake",))
