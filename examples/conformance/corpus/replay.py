"""Reported diffusion-replay bugs re-created in
``replay_batched(adapter, conditions, segment, strategy, target, guidance=None, config=None)``
(``--impl replay=corpus.replay:NAME``).

Each callable is ``zoo_replay``'s right batched replay with the one flaw its report describes (``REPORTS``).
Most reports concern a sampler or a training step rather than a batched replay; what carries over is the
mistake in the model call (which rows get which condition, which units the timestep is in), which a replay
that stacks several target steps into one forward makes just as easily.
"""

from __future__ import annotations

from dataclasses import replace

import zoo_replay
from zoo_replay import CORRECT

from corpus import Report

__all__ = ["REPORTS", "diffusers_sd3_pooled_embeds_rows_misaligned", "onetrainer_pooled_cfg_branches_swapped",
           "sglang_flux_guidance_scaled_twice", "step1x_edit_timestep_scaled_twice", "unirl_sigma_rounded_to_bf16"]

REPORTS = {
    "onetrainer_pooled_cfg_branches_swapped": Report(
        url="https://github.com/Nerogar/OneTrainer/issues/775",
        project="OneTrainer",
        version="master as of 2025-04 (StableDiffusionXLSampler)",
        mechanism=(
            "The SDXL sampler batched classifier-free guidance as [negative, positive] for the text encoder's "
            "sequence embeddings but as [positive, negative] for the pooled embeddings, then split the prediction "
            "as [negative, positive]. Each half of the batch thus saw one branch's token embeddings with the other "
            "branch's pooled embedding, and the guidance combined two mixed predictions."),
        recreation=("The pooled fields enter the two-branch forward in the other branch order than every other "
                    "field: for an uncond-first family (SD3, batched [negative; prompt] like the SDXL sampler) the "
                    "pooled fields of the two branches are exchanged before the forward concatenates them."),
        checks=("replay.sd3.cfg2.log_probs", "replay.sd3.cfg2.prev_sample_means", "replay.uncond_first.log_probs"),
        flaws=replace(CORRECT, pooled_branches_swapped=True)),
    "diffusers_sd3_pooled_embeds_rows_misaligned": Report(
        url="https://github.com/huggingface/diffusers/pull/12306",
        project="diffusers",
        version="main as of 2025-09 (StableDiffusion3Pipeline.encode_prompt; the same bug was fixed earlier for Flux)",
        mechanism=(
            "With several prompts and num_images_per_prompt > 1, the pipeline copied the CLIP and T5 sequence "
            "embeddings so each prompt's copies sit together (p0 p0 p1 p1) but copied the pooled embeddings as a "
            "whole batch (p0 p1 p0 p1). Rows of the two fields no longer belonged to the same prompt, so images "
            "were generated with another prompt's pooled embedding."),
        recreation=("When the conditions are copied for the S stacked target steps, the pooled fields are copied "
                    "row by row (r0 r0 r1 r1) while every other field, like the latents, is copied block by block "
                    "(r0 r1 r0 r1)."),
        checks=("replay.sd3.cfg1.log_probs", "replay.flux.cfg1.log_probs", "replay.uncond_first.log_probs"),
        flaws=replace(CORRECT, pooled_rows_interleaved=True)),
    "sglang_flux_guidance_scaled_twice": Report(
        url="https://github.com/sgl-project/sglang/pull/22059",
        project="sglang",
        version="main as of 2026-04 (multimodal_gen FLUX.1/FLUX.2 dev)",
        mechanism=(
            "Once the guidance embedder of the guidance-distilled FLUX checkpoints was actually loaded, the "
            "guidance value reached the model's sinusoidal embedding for the first time, and the helper building "
            "it multiplied the scale by 1000 (3.5 became 3500) although the transformer applies that factor itself, "
            "putting the embedding far outside the range the model was trained on."),
        recreation=("The embedded-guidance field of a guidance-distilled Flux is multiplied by 1000 before the "
                    "forward, whose model multiplies it by 1000 again."),
        checks=("replay.flux.cfg1.log_probs", "replay.flux.cfg2.log_probs"),
        flaws=replace(CORRECT, guidance_embed_x1000=True)),
    "step1x_edit_timestep_scaled_twice": Report(
        url="https://github.com/stepfun-ai/Step1X-Edit/issues/91",
        project="Step1X-Edit",
        version="initial release (finetuning.py with the connector; fixed before 2025-06-16)",
        mechanism=(
            "The fine-tuning script handed the model a timestep already in 0-1000, and the connector multiplied "
            "its timestep by 1000 again, so it embedded values up to 1,000,000 while the DiT itself saw the right "
            "range: two components of one forward disagreed about the timestep's units."),
        recreation=("Sigma is scaled to 0-1000 before the family's timestep hook, which scales (or shifts) it "
                    "again, so the model sees the timestep of another noise level entirely."),
        checks=("replay.sd3.cfg1.log_probs", "replay.flux.cfg1.log_probs", "replay.qwen_image.cfg1.log_probs"),
        flaws=replace(CORRECT, timestep_x1000=True)),
    "unirl_sigma_rounded_to_bf16": Report(
        url="https://github.com/Tencent-Hunyuan/UniRL/pull/438",
        project="UniRL",
        version="main as of 2026-09 (HunyuanVideo10DiffusionStep.predict_noise)",
        mechanism=(
            "The training-side replay cast sigma to the transformer's bf16 before multiplying by 1000, while the "
            "rollout engines keep the scaled timestep in fp32. bf16 keeps about three significant digits of a "
            "value in [0, 1], so on most steps the replayed timestep was quantized, by up to a few units out of "
            "1000: the policy was evaluated at other timesteps than the ones that produced the trajectory."),
        recreation=("Sigma is rounded through bf16 before the family's timestep hook; the SDE step itself still "
                    "uses the exact sigma."),
        checks=("replay.sd3.cfg1.log_probs", "replay.flux.cfg1.log_probs", "replay.cfg1.log_probs"),
        flaws=replace(CORRECT, sigma_rounded_bf16=True)),
}


_MADE = {name: report.recreate(zoo_replay._implementation) for name, report in REPORTS.items()}
onetrainer_pooled_cfg_branches_swapped = _MADE["onetrainer_pooled_cfg_branches_swapped"]
diffusers_sd3_pooled_embeds_rows_misaligned = _MADE["diffusers_sd3_pooled_embeds_rows_misaligned"]
sglang_flux_guidance_scaled_twice = _MADE["sglang_flux_guidance_scaled_twice"]
step1x_edit_timestep_scaled_twice = _MADE["step1x_edit_timestep_scaled_twice"]
unirl_sigma_rounded_to_bf16 = _MADE["unirl_sigma_rounded_to_bf16"]
