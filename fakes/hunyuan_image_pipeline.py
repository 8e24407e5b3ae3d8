"""The fake HunyuanImage-3 upstream's sampling loop: what its ``model.pipeline`` (``HunyuanImage3Text2ImagePipeline``
with ``FlowMatchDiscreteScheduler`` and ``ClassifierFreeGuidance``) does with the model, held to the real loop by
``fixtures.gen_image_contract`` and the pipeline oracle.

- The flow-matching Euler schedule: sigmas ``linspace(1, 0, n + 1)`` time-shifted ``shift s / (1 + (shift - 1) s)``;
  the model's timestep is ``1000 sigma`` (fp32); a step is ``x + v (sigma_next - sigma)`` in fp32.
- CFG: the batch is ``[cond_B; uncond_B]``, the latents repeated for both halves; ``uncond + g (cond - uncond)``
  when ``g > 1``, the prediction itself otherwise.
- The first step runs the whole sequence (``first_step=True``) with the mask the model's own mask builder makes
  from ``tokenizer_output``; the model's kwargs update then narrows later steps to the timestep and image tokens
  over the cache. The fake has no VAE: the loop returns the final latents. The module imports torch and
  ``harness.inputs.compat`` only.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.inputs import compat

__all__ = ["ClassifierFreeGuidance", "FlowMatchDiscreteScheduler", "HunyuanImage3Text2ImagePipeline"]


class FlowMatchDiscreteScheduler:
    """Euler steps on a time-shifted flow-matching schedule (``reverse``: sigma runs from 1 down to 0)."""

    order = 1

    def __init__(self, num_train_timesteps: int = 1000, shift: float = 1.0, reverse: bool = True,
                 solver: str = "euler") -> None:
        if solver != "euler" or not reverse:
            raise NotImplementedError("the fake schedules euler steps from sigma 1 down to 0 only")
        self.num_train_timesteps, self.shift = num_train_timesteps, float(shift)
        self.sigmas = torch.linspace(1, 0, num_train_timesteps + 1)
        self.timesteps = (self.sigmas[:-1] * num_train_timesteps).float()
        self._step_index: int | None = None

    def set_timesteps(self, num_inference_steps: int, device: torch.device | str | None = None) -> None:
        sigmas = torch.linspace(1, 0, num_inference_steps + 1)
        if self.shift != 1.0:
            sigmas = self.shift * sigmas / (1 + (self.shift - 1) * sigmas)
        self.sigmas = sigmas
        self.timesteps = (sigmas[:-1] * self.num_train_timesteps).to(dtype=torch.float32, device=device)
        self._step_index = None

    def scale_model_input(self, sample: torch.Tensor, timestep: Any = None) -> torch.Tensor:
        return sample

    def step(self, model_output: torch.Tensor, timestep: torch.Tensor, sample: torch.Tensor,
             return_dict: bool = False, **_: Any) -> tuple[torch.Tensor]:
        """``sample + model_output (sigma_next - sigma)`` in fp32, at the schedule's next step."""
        if self._step_index is None:
            matches = (self.timesteps == timestep.to(self.timesteps.device)).nonzero()
            self._step_index = int(matches[1 if len(matches) > 1 else 0])
        sigma, sigma_next = self.sigmas[self._step_index], self.sigmas[self._step_index + 1]
        prev = sample.to(torch.float32) + model_output.to(torch.float32) * (sigma_next - sigma)
        self._step_index += 1
        return (prev,)


class ClassifierFreeGuidance:
    """``uncond + scale (cond - uncond)``."""

    def __call__(self, pred_cond: torch.Tensor, pred_uncond: torch.Tensor, guidance_scale: float,
                 step: int) -> torch.Tensor:
        return pred_uncond + guidance_scale * (pred_cond - pred_uncond)


class HunyuanImage3Text2ImagePipeline:
    """The denoising loop around a fake upstream model (``model.pipeline``): upstream's call signature and order of
    hook calls; ``timestep_arg`` is the name the model's forward takes its timesteps under."""

    def __init__(self, model: Any, scheduler: FlowMatchDiscreteScheduler, timestep_arg: str,
                 keeps_input_ids: bool) -> None:
        self.model, self.scheduler = model, scheduler
        self.timestep_arg, self.keeps_input_ids = timestep_arg, keeps_input_ids
        self.cfg_operator = ClassifierFreeGuidance()

    @torch.no_grad()
    def __call__(self, batch_size: int, image_size: list[int], num_inference_steps: int = 50,
                 guidance_scale: float = 7.5, generator: Any = None, latents: torch.Tensor | None = None,
                 model_kwargs: dict[str, Any] | None = None, **_: Any) -> tuple[torch.Tensor]:
        model, model_kwargs = self.model, dict(model_kwargs or {})
        cfg_factor = 1 + (guidance_scale > 1.0)
        self.scheduler.set_timesteps(num_inference_steps, model.device)
        if latents is None:
            factor = model.config.vae_downsample_factor
            shape = (batch_size, int(model.config.vae["latent_channels"]),
                     *(int(s) // int(f) for s, f in zip(image_size, factor, strict=True)))
            latents = torch.randn(shape, generator=generator, dtype=torch.float32)
        input_ids = model_kwargs.pop("input_ids")
        model_kwargs["attention_mask"] = model._prepare_attention_mask_for_generation(
            input_ids, model.generation_config, model_kwargs=model_kwargs).to(latents.device)
        timesteps = self.scheduler.timesteps
        for i, t in enumerate(timesteps):
            model_input = torch.cat([latents] * cfg_factor)
            inputs = model.prepare_inputs_for_generation(
                input_ids, images=model_input, **{self.timestep_arg: t.repeat(model_input.shape[0])}, **model_kwargs)
            output = model(**inputs, first_step=(i == 0))
            pred = output["diffusion_prediction"].to(torch.float32)
            if cfg_factor == 2:
                pred_cond, pred_uncond = pred.chunk(2)
                pred = self.cfg_operator(pred_cond, pred_uncond, guidance_scale, step=i)
            latents = self.scheduler.step(pred, t, latents, return_dict=False)[0]
            if i != len(timesteps) - 1:
                # on transformers 5 the update files the cache under ``cache``, where upstream's prepare step never
                # looks (upstream itself runs on 4.x only): carried over as the harness carries it
                updated = model._update_model_kwargs_for_generation(output, model_kwargs)
                model_kwargs = compat.remote_code_kwargs(updated)
                if not self.keeps_input_ids:
                    input_ids = None
                elif input_ids.shape[1] != model_kwargs["position_ids"].shape[1]:
                    input_ids = torch.gather(input_ids, 1, index=model_kwargs["position_ids"])
        return (latents,)
