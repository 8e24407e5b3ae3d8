"""``--impl replay.sd3=parity_adapters.replay:sd3_replay`` and ``replay.hunyuan_image3=...:hunyuan_image3_replay``."""

from __future__ import annotations

from typing import Any

import torch
from flowstage.hunyuan_image3 import HunyuanImage3DiffusionStage
from flowstage.sd3 import SD3DiffusionStage
from flowstage.sde import DPM2Strategy, FlowGRPOStrategy
from flowstage.types import (
    DiffusionSamplingParams,
    HunyuanImage3Conditions,
    LatentSegment,
    SD3Conditions,
    TextEmbedCondition,
)

from harness.plugins.declarations import ReplayDeclaration
from harness.replay.sde import FlowGRPOSDE
from harness.replay.segment import ReplayResult

PRECISION = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _scale(guidance: Any, guided: bool) -> float:
    """flowstage samples a rollout at one guidance scale: a per-step schedule is refused, never flattened."""
    if not guided:
        return 1.0
    if isinstance(guidance, bool) or not isinstance(guidance, (int, float)):
        raise ValueError(f"flowstage replays one guidance scale per rollout, got {type(guidance).__name__}")
    return float(guidance)


def sd3_conditions(c: Any) -> SD3Conditions:
    def text(rows: dict[str, torch.Tensor]) -> TextEmbedCondition:
        return TextEmbedCondition(rows["encoder_hidden_states"], rows["pooled_projections"])
    return SD3Conditions(text(c.rows), None if c.negative is None else text(c.negative.rows))


def hunyuan_image3_conditions(c: Any) -> HunyuanImage3Conditions:
    rows = c.rows  # the runner CFG-expands: the uncond branch sees the same conditional images
    images = list(rows["cond_vae_images"]) * c.cfg_factor
    return HunyuanImage3Conditions(*(rows[name] for name in ("input_ids", "attention_mask", "image_mask",
                                                             "timesteps_index", "rope_image_info")), images,
                                   rows["cond_vae_image_mask"], rows["cond_timesteps_index"],
                                   c.shared["position_ids"], cfg_expanded=c.cfg_factor == 2)


def replay_with(stage_class: type, translate: Any) -> Any:
    def replay_batched(adapter, conditions, segment, strategy, target, guidance=None, config=None):
        steps = FlowGRPOStrategy() if isinstance(strategy, FlowGRPOSDE) else DPM2Strategy()
        stage = stage_class(model=adapter.module, strategy=steps, trajectory_precision=PRECISION[segment.dtype],
                            batch_replay_steps=bool(config is not None and config.batch_replay_steps))
        params = DiffusionSamplingParams(_scale(guidance, conditions.guided), getattr(strategy, "eta", 0.0))
        stored, device = LatentSegment(segment.latents, segment.latent_steps), segment.latents.device
        result = stage._replay_batched(translate(conditions), segment=stored, params=params, target=list(target),
                                       sigmas=segment.sigmas, sigma_max=segment.sigma_max, device=device)
        return None if result is None else ReplayResult(result.log_probs, result.prev_sample_means, tuple(target))
    return replay_batched


sd3_replay = replay_with(SD3DiffusionStage, sd3_conditions)
sd3_replay.declares = ReplayDeclaration(families=("sd3",), cfg_layouts=("uncond_first",), guidance="scale",
                                        means_dtype="trajectory")
hunyuan_image3_replay = replay_with(HunyuanImage3DiffusionStage, hunyuan_image3_conditions)
hunyuan_image3_replay.declares = ReplayDeclaration(families=("hunyuan_image3",), cfg_layouts=("fused_cond_first",),
                                                   guidance="scale", means_dtype="trajectory")
