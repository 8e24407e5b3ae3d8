"""The pipeline oracle of HunyuanImage-3: the family's adapter held to the model's own sampling loop.

HunyuanImage-3's loop is not a diffusers pipeline: it ships in the model's remote code (``model.pipeline``, upstream's
``HunyuanImage3Text2ImagePipeline`` with its ``FlowMatchDiscreteScheduler`` and ``ClassifierFreeGuidance``; the fake
upstream has its own). Its first step runs the whole sequence, its later steps only the timestep and image tokens
over a KV cache of the first; replay runs every step as a first step. The oracle runs that loop on the loaded model
from the family's example model kwargs, records every model call (its arguments bound to ``forward``'s signature
and its ``diffusion_prediction``) and what the loop hands its scheduler, then runs the adapter's denoiser at the
same latents and sigma and holds it to the loop, step by step:

- inputs: the timestep within ``TIMESTEP_ULPS`` fp32 ulps of the loop's; the latents bitwise; at the first step
  every other input (token ids, the 4-D mask, image mask, timestep indices, RoPE, conditional images) row by row;
  the rows the adapter declares cond carry the loop's cond rows (upstream's batch is ``[cond_B; uncond_B]``);
- outputs: each branch's prediction and the velocity within ``K_OUTPUT`` x a floor: the model's first-step forward
  on the adapter's inputs with its rows regrouped (each CFG branch alone), a batch-shape control on stock code,
  held under its ceiling; so a later step's cached forward and the adapter's full one may differ by rounding only;
- the family's combine of the loop's own branch predictions equals what the loop handed its scheduler.

Any dtype: the loop runs the model under ``torch.autocast`` (upstream's names CUDA in bf16; for a low-precision model
on another device the oracle enters that device's autocast in the model's dtype, without which the loop's fp32
latents cannot meet its weights), the hook records the autocast each forward ran under, and the adapter's forward and
the control run under the same one: the oracle compares how the adapter translates a step, in the arithmetic the loop
used. Floors are counted in ulps of that arithmetic's dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from harness.judging.compare import Verdict, close, holds
from harness.judging.floors import module_reduction_terms
from harness.replay import denoiser
from harness.replay import pipeline_oracle as oracle
from harness.replay.families.base import ModelAdapter, Prompts, ReplayFamily
from harness.replay.pipeline_oracle import Forward, OracleError, PipelineRecord, PipelineStep

__all__ = ["DTYPES", "FLOW_SHIFT", "ORACLE", "HunyuanPipelineOracle", "ImageForward", "record_image_forwards"]

FLOW_SHIFT = 3.0  # the schedule's time shift when the checkpoint's generation config names none
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the model dtypes this oracle judges (module docstring)


@dataclasses.dataclass(frozen=True, eq=False)
class ImageForward(Forward):
    """A model call and the autocast dtype it ran under on its device (None: no autocast)."""

    autocast: torch.dtype | None = None


def _autocast_of(device: torch.device) -> torch.dtype | None:
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def _autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """The autocast a recorded forward ran under, entered again (nothing when it ran under none)."""
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


@contextlib.contextmanager
def record_image_forwards(module: torch.nn.Module, autocast: torch.dtype | None = None) -> Iterator[list[Forward]]:
    """Every forward of ``module`` while the block runs: its arguments bound to ``forward``'s signature (defaults
    applied), a copy of its ``diffusion_prediction`` and the autocast it ran under (``autocast`` when the caller
    entered one inside the call, ``forward_under_autocast``: the innermost one)."""
    calls: list[Forward] = []

    def hook(mod, args, kwargs, output) -> None:
        bound = inspect.signature(mod.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        prediction = output["diffusion_prediction"]
        calls.append(ImageForward(dict(bound.arguments), prediction.detach().clone(),
                                  autocast if autocast is not None else _autocast_of(prediction.device)))

    handle = module.register_forward_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


class _LoopEnded(Exception):
    """Raised where the loop hands its latents to its VAE: every model call and scheduler step is behind it."""


@contextlib.contextmanager
def _ends_at_the_vae(pipe: Any) -> Iterator[None]:
    """The loop stopped where it decodes (both generations decode whatever ``output_type`` asks, under a CUDA-only
    autocast): what follows makes no model call or scheduler step, so the record is whole there, in any dtype."""
    vae = getattr(pipe, "vae", None)
    if vae is None or not hasattr(vae, "decode"):
        yield
        return

    def decode(*args: Any, **kwargs: Any) -> Any:
        raise _LoopEnded

    vae.decode = decode
    try:
        yield
    finally:
        del vae.decode


@contextlib.contextmanager
def forward_under_autocast(model: torch.nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """``model``'s forward run under its device's autocast in ``dtype`` while the block runs (nothing for None): the
    scope upstream's loop gives its own (CUDA) autocast, the model call alone, so the loop's VAE and scheduler keep
    their own dtypes."""
    if dtype is None:
        yield
        return
    original = model.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(model.device.type, dtype=dtype):
            return original(*args, **kwargs)

    model.forward = forward
    try:
        yield
    finally:
        del model.forward


def _rows(value: Any, lo: int, hi: int) -> Any:
    """Rows ``[lo, hi)`` of a forward argument: a tensor's or a list's rows, each part of a tuple of tensors (RoPE
    tables), anything else (a mode, a flag, None) as it is."""
    if isinstance(value, torch.Tensor) and value.dim():
        return value[lo:hi]
    if isinstance(value, list):
        return value[lo:hi]
    if isinstance(value, tuple) and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(v[lo:hi] for v in value)
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and torch.equal(a.double(), b.double()))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _row_index(order: list[tuple[str, int]], batch: int) -> list[int]:
    """The loop's row of each (branch, sample) of ``order``: its batch is ``[cond_B; uncond_B]``."""
    return [b if branch == "cond" else batch + b for branch, b in order]


def _pick(value: Any, index: list[int]) -> Any:
    if isinstance(value, torch.Tensor) and value.dim():
        return value[index]
    if isinstance(value, list):
        return [value[i] for i in index]
    if isinstance(value, tuple) and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(v[index] for v in value)
    return value


class HunyuanPipelineOracle:
    """``PipelineSpec.oracle`` of the HunyuanImage-3 family (module docstring)."""

    dtypes = DTYPES  # the model dtypes it judges

    # ------------------------------------------------------------------ running the loop
    def run_pipeline(self, family: ReplayFamily, adapter: ModelAdapter, prompts: Prompts, latents: torch.Tensor,
                     guidance: float, steps: int = oracle.ORACLE_STEPS) -> PipelineRecord:
        """The model's own loop for ``steps`` steps from ``prompts`` (upstream's model kwargs, fused CFG batch) and
        fp32 ``latents``; its scheduler's schedule shifted by the generation config's ``flow_shift`` (``FLOW_SHIFT``
        when the config names none). A low-precision model off CUDA runs under its device's autocast in its dtype
        (module docstring)."""
        model = adapter.module
        dtype = getattr(model, "dtype", None)  # upstream keeps some parameters (its MoE gate) in fp32 beside bf16
        if latents.dtype != torch.float32 or dtype not in DTYPES:
            weights = sorted({str(p.dtype) for p in model.parameters()})
            raise OracleError(f"the pipeline oracle judges a model whose dtype is one of {[str(d) for d in DTYPES]} "
                              f"from fp32 latents; the model's dtype is {dtype} (its parameters hold {weights}), the "
                              f"latents {latents.dtype}")
        device = latents.device
        own_autocast = dtype if dtype != torch.float32 and device.type != "cuda" else None
        if getattr(model.generation_config, "flow_shift", None) is None:
            model.generation_config.flow_shift = FLOW_SHIFT
        pipe = model.pipeline
        adapter.as_generate_sets(prompts["image_mask"])
        batch = latents.shape[0]
        width = prompts["input_ids"].shape[1]
        kwargs = {**prompts, "past_key_values": adapter.new_cache(prompts["input_ids"].shape[0], width)}
        factor = model.config.vae_downsample_factor
        h, w = adapter.latent_size
        scheduled: list[tuple[torch.Tensor, torch.Tensor]] = []
        step = pipe.scheduler.step

        def recording_step(model_output, timestep, sample, *args, **kw):
            scheduled.append((model_output.detach().clone(), sample.detach().clone()))
            return step(model_output, timestep, sample, *args, **kw)

        pipe.scheduler.step = recording_step
        try:
            with (torch.no_grad(), forward_under_autocast(model, own_autocast), _ends_at_the_vae(pipe),
                  record_image_forwards(model, own_autocast) as calls):
                pipe(batch_size=batch, image_size=[h * int(factor[0]), w * int(factor[1])],
                     num_inference_steps=steps, guidance_scale=guidance, latents=latents.clone(),
                     model_kwargs=kwargs, output_type="latent")
        except _LoopEnded:
            pass
        finally:
            del pipe.scheduler.step
        if len(scheduled) != steps or len(calls) != steps:
            raise OracleError(f"the model's loop made {len(calls)} model calls and {len(scheduled)} scheduler steps "
                              f"for num_inference_steps={steps}; expected one of each per step (both CFG branches "
                              "in one call)")
        sigmas = pipe.scheduler.sigmas
        return PipelineRecord(prompts, guidance, latents.clone(), tuple(
            PipelineStep(sigmas[i].to(torch.float32), sample, output, (calls[i],))
            for i, (output, sample) in enumerate(scheduled)))

    # ------------------------------------------------------------------ lining the loop up with the adapter
    def align(self, step: PipelineStep, prompts: Prompts, order: list[tuple[str, int]]) -> oracle.AlignedStep:
        """The loop's call of one step with its rows laid out in ``order`` (the loop's batch is ``[cond; uncond]``)."""
        forward = step.forwards[0]
        batch = len(order) // 2
        rows_in = int(forward.output.shape[0])
        if rows_in != 2 * batch:
            raise OracleError(f"the model's loop ran {rows_in} rows at a step; expected both CFG branches of "
                              f"{batch} samples ({2 * batch} rows)")
        index = _row_index(order, batch)
        rows = {name: _pick(value, index) for name, value in forward.arguments.items()
                if _count(value) == rows_in}
        shared = {name: value for name, value in forward.arguments.items() if name not in rows}
        return oracle.AlignedStep(order, rows, shared, forward.output[index])

    # ------------------------------------------------------------------ judging
    def judge_family(self, family: ReplayFamily, adapter: ModelAdapter, record: PipelineRecord) -> Verdict:
        started = record.steps[0].latents
        start = holds(started.shape == record.start.shape and torch.equal(started, record.start),
                      "step 0: the loop stepped the latents it was given", start_shape=str(tuple(started.shape)))
        first = record.steps[0].forwards[0]
        verdicts = [self.judge_step(adapter, step, first, record.prompts, record.guidance, f"step {i}")
                    for i, step in enumerate(record.steps)]
        return functools.reduce(Verdict.merge, verdicts, start)

    def judge_step(self, adapter: ModelAdapter, step: PipelineStep, first: Forward, prompts: Prompts,
                   guidance: float, label: str) -> Verdict:
        """The adapter's denoiser at the step's latents and sigma against the loop's step (module docstring)."""
        conditions = adapter.conditions_from_prompts(prompts, 2)
        batch = conditions.batch
        x = step.latents
        sigmas = step.sigma.expand(batch)
        autocast = getattr(step.forwards[0], "autocast", None)
        arithmetic = autocast or adapter.module.dtype  # the dtype the loop's forward computed in
        with torch.no_grad(), _autocast(x.device, autocast), record_image_forwards(adapter.module) as calls:
            velocity = denoiser.predict_velocity(adapter, x, sigmas, conditions, guidance)
        rows = [int(c.output.shape[0]) for c in calls]
        ran = holds(rows == [2 * batch], f"{label}: the denoiser ran one forward of both CFG branches "
                                        f"({2 * batch} rows)", forwards=str(rows))
        if not ran.passed:
            return ran
        mine = calls[0]
        order = oracle.adapter_order(denoiser.declared_layout(adapter), batch)
        index = _row_index(order, batch)
        aligned = self.align(step, prompts, order)
        t_name = _timestep_name(mine)
        t_loop = step.forwards[0].arguments[t_name].double()
        t_mine = torch.as_tensor(mine.arguments[t_name]).double()
        scale = float(t_loop.abs().max())
        verdict = close(atol=oracle.TIMESTEP_ULPS * oracle.FP32_EPS * scale, rtol=0.0,
                        reason=f"timestep in the loop's units: within {oracle.TIMESTEP_ULPS:g} fp32 ulps of its "
                               f"magnitude {scale:.4g}").judge(t_mine, t_loop[index], dims=("row",),
                                                              what=f"{label} timestep")
        declared = mine.arguments["input_ids"]
        loop_ids = first.arguments["input_ids"]
        cfg_order = _same(declared, loop_ids[index]) if declared.shape == loop_ids.shape else False
        verdict = verdict.require(cfg_order, f"{label}: CFG order: the rows the adapter declares cond carry the "
                                             "loop's cond rows (its batch is [cond_B; uncond_B]), the uncond rows its "
                                             "uncond rows")
        mismatched = self._input_mismatches(mine, first, step.forwards[0], index,
                                            bool(step.forwards[0].arguments.get("first_step")))
        verdict = verdict.require(not mismatched, f"{label}: every other model input equals the loop's, row by row",
                                  **{f"input_{k}": v for k, v in mismatched.items()})
        with _autocast(x.device, autocast):
            regrouped = self._regrouped(adapter, mine, batch)
        terms = module_reduction_terms(adapter.module, sequence=int(mine.arguments["input_ids"].shape[1]))
        floor = oracle._rounding_floor(float(oracle.relative_error(regrouped, mine.output).max()), terms,
                                       "the model's first-step forward on the adapter's inputs, each CFG branch alone",
                                       arithmetic)
        reference = step.model_output
        own = oracle._combined(adapter, aligned.output.float(), order, guidance, x, sigmas)  # the loop guides in fp32
        verdict = verdict.merge(oracle.judge_combine(
            f"{label} combine", own, reference,
            f"the family's {adapter.cfg_combine} combine and {adapter.velocity_transform} velocity of the loop's own "
            "branch predictions vs what it handed its scheduler"))
        verdict = verdict.merge(oracle._within(f"{label} branch outputs", mine.output, aligned.output, floor, 0.0,
                                               "each branch's prediction vs the loop's"))
        combined_floor = oracle._rounding_floor(
            float(oracle.relative_error(oracle._combined(adapter, regrouped.float(), order, guidance, x, sigmas),
                                        oracle._combined(adapter, mine.output.float(), order, guidance, x,
                                                         sigmas)).max()),
            terms + adapter.latent_shape[0], "the family's combine of those control outputs", arithmetic)
        verdict = verdict.merge(oracle._within(f"{label} velocity", velocity, reference, combined_floor, 0.0,
                                               "the denoiser's velocity vs what the loop handed its scheduler"))
        return verdict.with_metrics(**{f"{label}_arithmetic": str(arithmetic).removeprefix("torch."),
                                       f"{label}_timestep_loop": scale, f"{label}_branch_floor": floor.measured,
                                       f"{label}_branch_floor_ceiling": floor.ceiling,
                                       f"{label}_velocity_floor": combined_floor.measured})

    @staticmethod
    def _input_mismatches(mine: Forward, first: Forward, now: Forward, index: list[int],
                          first_step: bool) -> dict[str, str]:
        """Model arguments where the adapter's call differs from the loop's: the latents at every step; at the
        first step (the only one whose call is a whole-sequence forward like the adapter's) every row argument and
        the mode; the cache, which only the loop keeps, aside."""
        found = {}
        if not _same(mine.arguments["images"], _pick(now.arguments["images"], index)):
            found["images"] = "the latents differ from the loop's"
        if not first_step:
            return found
        rows = int(first.output.shape[0])
        for name, value in sorted(first.arguments.items()):
            if name in ("images", "past_key_values", "use_cache", "return_dict") or name == _timestep_name(mine):
                continue
            expected = _pick(value, index) if _count(value) == rows else value
            if not _same(mine.arguments.get(name), expected):
                found[name] = "differs from the loop's (rows in the adapter's order)"
        return found

    @staticmethod
    def _regrouped(adapter: ModelAdapter, mine: Forward, batch: int) -> torch.Tensor:
        """The model's first-step forward on the adapter's own inputs, each CFG branch in a forward of its own."""
        halves = []
        for lo, hi in ((0, batch), (batch, 2 * batch)):
            arguments = {name: _rows(value, lo, hi) for name, value in mine.arguments.items()}
            with torch.no_grad():
                halves.append(adapter.module(**arguments)["diffusion_prediction"])
        return torch.cat(halves)



def _count(value: Any) -> int | None:
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() else None
    if isinstance(value, list):
        return len(value)
    if isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
        counts = {int(v.shape[0]) for v in value}
        return counts.pop() if len(counts) == 1 else None
    return None


def _timestep_name(forward: Forward) -> str:
    """The name a generation's forward takes its timesteps under (generation 1 takes ``custom_pos_emb``)."""
    return "timestep" if "custom_pos_emb" in forward.arguments else "timesteps"


ORACLE = HunyuanPipelineOracle()  # what the family's PipelineSpec names
