"""GPU tier of replay: a real diffusers DiT or HunyuanImage-3's image forward, batched-step replay vs the serial loop,
fp32 and bf16.

The checkpoint's model class picks its replay family through the registries (harness.plugins.entry_points:
CHECKPOINT_KINDS -> REPLAY_FAMILIES), so an installed family's checkpoint runs here unchanged. A HunyuanImage-3
checkpoint (an ar kind) feeds replay too when its config names the image forward's latent channels (``drives``):
its family drives the causal MM model's ``forward(mode="gen_image")``, loaded through ``--device-map`` like the ar
check's.
Its example conditions discriminate (every row field differs across rows and CFG branches, or the family
refuses them, harness.replay.discriminating), so a mask or branch bug cannot hide behind equal rows.
Both dtypes are judged by a local-scale bound built from the STOCK batch-shape control (serial
replay at B rows vs the same rows inside an S x larger batch): k x the control's deviation relative
to the local magnitude, per row (log-probs) or per row and step (means). The batched replay run
twice must give ratio exactly 1 in either dtype.

``replay.gpu.oracle.pipeline`` holds the family's adapter to the checkpoint's own sampling loop (the pipeline
oracle, harness.replay.pipeline_oracle, on the loaded model): what batched and serial replay share (the timestep's
units, the CFG order, the guidance combine) is checked against what the loop does. A family whose oracle judges a
dtype runs in it (HunyuanImage-3's own loop: any dtype, under the autocast the loop runs its model in); a diffusers
pipeline is judged in fp32, and its low-precision item is skipped saying so.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from harness.inputs import checkpoints
from harness.judging.checkid import CheckId
from harness.judging.checks import CheckContext
from harness.judging.compare import Verdict
from harness.replay import pipeline_oracle
from harness.replay.conditions import Conditions
from harness.replay.controls import BatchShapeControl, measure_batch_shape_control
from harness.replay.denoiser import DenoiserAdapter, WrappedAdapter
from harness.replay.families import ReplayFamily, family_for_class
from harness.replay.judge import compare_replay, compare_replay_determinism
from harness.replay.policies import LocalScaleBound, local_scale_policy
from harness.replay.problem import ReplayProblem, make_problem

__all__ = ["ALSO_FEEDS", "GPU_CHECKS", "ORACLE_ID", "ORACLE_POLICY", "DeviceAdapter", "checkpoint_problem", "drives",
           "oracle_check", "oracle_skip_reason", "replay_check", "replay_policy"]

BATCH = 2
GPU_CHECKS = ("log_probs", "prev_sample_means", "replay_determinism")
ALSO_FEEDS = ("replay",)
ORACLE_ID = str(CheckId("replay", "gpu", "oracle", "pipeline"))
ORACLE_GUIDANCE = 4.5  # a guidance scale above 1, so the loop runs both CFG branches and combines them
ORACLE_POLICY = (f"model inputs: the timestep within {pipeline_oracle.TIMESTEP_ULPS:g} fp32 ulps of the loop's, the "
                 "CFG order and every other input row by row; branch outputs and velocity: relative error <= "
                 f"{pipeline_oracle.K_OUTPUT:g} x the stock floor (the model on the adapter's inputs, each CFG branch "
                 "alone), at least 4 ulps of the arithmetic's dtype; the family's combine of the loop's own branch "
                 "outputs equals what the loop stepped on")


def drives(checkpoint: checkpoints.Checkpoint) -> bool:
    """Whether replay can drive a checkpoint of another path's kind: a HunyuanImage-3 model whose config.json (read
    as data) names its image forward's latent channels, ``vae["latent_channels"]``."""
    vae = checkpoint.config.get("vae")
    return isinstance(vae, dict) and isinstance(vae.get("latent_channels"), int)


def _to(value: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    """``value`` (a tensor, or a list or tuple of them) on ``device``, a floating one in ``dtype`` (None: its own)."""
    if isinstance(value, torch.Tensor):
        keep = dtype is None or not value.is_floating_point()
        return value.to(device=device, dtype=value.dtype if keep else dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device, dtype) for v in value)
    return value


class DeviceAdapter(WrappedAdapter):
    """Runs an adapter's forward on the model's device and dtype; replay math stays fp32 on the CPU.

    Only the transformer call moves, so stock and fast replay differ in nothing but the batch shape.
    """

    def __init__(self, inner: DenoiserAdapter, device: torch.device, dtype: torch.dtype):
        super().__init__(inner)
        self.device, self.dtype = device, dtype

    def forward(self, hidden: torch.Tensor, timestep: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        moved = Conditions(batch=conditions.batch, rows={k: _to(v, self.device, self.dtype)
                                                         for k, v in conditions.rows.items()},
                           shared={k: _to(v, self.device, self.dtype) for k, v in conditions.shared.items()},
                           cfg_factor=conditions.cfg_factor)
        with torch.no_grad():
            out = self.inner.forward(_to(hidden, self.device, self.dtype), _to(timestep, self.device, self.dtype),
                                     moved)
        return out.float().cpu()


@functools.cache
def _model(path: str, dtype: torch.dtype, device: str) -> Any:
    """The loaded model: an ar checkpoint's (HunyuanImage-3) is the one the ar check loaded, so an 80B model is held
    once, and refused alike (skipped, naming its generation, where the installed transformers cannot import it)."""
    checkpoint = checkpoints.detect(path)
    if checkpoint.feeds == "ar":
        from gpu import ar

        return ar.checkpoint_backend(path, dtype, device).model
    return checkpoints.load_model(checkpoint, dtype, device)


def _family(path: str) -> ReplayFamily:
    checkpoint = checkpoints.detect(path)
    try:
        return family_for_class(checkpoint.class_name)
    except LookupError as err:
        raise checkpoints.CheckpointError(f"checkpoint {path}: {err}") from None


def oracle_skip_reason(path: str, dtype: torch.dtype) -> str | None:
    """Why the pipeline oracle does not judge this checkpoint in ``dtype`` (None: it does). A family's own oracle
    names the dtypes it judges (``dtypes``); the diffusers pipelines' oracle judges fp32 (its floors and its
    timestep room are fp32's)."""
    family = _family(path)
    if family.pipeline is None:
        return f"replay family {family.name!r} registers no pipeline: the pipeline oracle has nothing to hold it to"
    judged = getattr(family.pipeline.own_oracle(), "dtypes", (torch.float32,))
    if dtype in judged:
        return None
    names = ", ".join(str(d).removeprefix("torch.") for d in judged)
    return (f"the pipeline oracle of replay family {family.name!r} ({family.pipeline.class_name}) judges {names}: its "
            f"fp32 item judges this checkpoint's adapter against the pipeline")


@functools.cache
def _oracle_record(path: str, dtype: torch.dtype, device: str) -> tuple[Any, pipeline_oracle.PipelineRecord]:
    """The family's adapter on the loaded model and the record of its own loop, two steps from seeded example
    prompts (no seam an ablation patches runs in the loop: recorded once per checkpoint and dtype)."""
    family = _family(path)
    model = _model(path, dtype, device)
    adapter = family.adapter(model)
    where = next(model.parameters()).device
    prompts = {k: _to(v, where, None) for k, v in adapter.example_prompts(
        BATCH, 2, torch.Generator().manual_seed(17)).items()}
    latents = torch.randn((BATCH, *adapter.latent_shape), generator=torch.Generator().manual_seed(18)).to(where)
    return adapter, pipeline_oracle.run_pipeline(family, adapter, prompts, latents, ORACLE_GUIDANCE)


def oracle_check(ctx: CheckContext) -> Verdict:
    """The family's adapter against the checkpoint's own sampling loop in ctx.dtype (module docstring)."""
    path = str(ctx.checkpoint)
    reason = oracle_skip_reason(path, ctx.dtype)
    if reason is not None:
        pytest.skip(reason)
    adapter, record = _oracle_record(path, ctx.dtype, str(ctx.device))
    return pipeline_oracle.judge_family(_family(path), adapter, record)


@functools.cache
def checkpoint_problem(path: str, dtype: torch.dtype, device: str, cfg: int) -> ReplayProblem:
    """A seeded rollout on the real DiT, driven by the registered family of its model class."""
    checkpoint = checkpoints.detect(path)
    family = _family(path)
    inner = family.adapter(_model(path, dtype, device))
    adapter = DeviceAdapter(inner, torch.device(device), dtype)
    conditions = family.example_conditions(inner, BATCH, cfg, torch.Generator().manual_seed(100 + cfg))
    return make_problem(f"{checkpoint.name}.cfg{cfg}", adapter, conditions, seed=cfg,
                        latent_shape=inner.latent_shape)


@functools.cache
def _control(path: str, dtype: torch.dtype, device: str, cfg: int) -> BatchShapeControl:
    return measure_batch_shape_control(checkpoint_problem(path, dtype, device, cfg))


def replay_policy(path: str, dtype: torch.dtype, device: str, what: str) -> LocalScaleBound:
    """The local-scale bound for ``what`` in ``dtype`` from this checkpoint's stock control (cfg 2)."""
    return local_scale_policy(_control(path, dtype, device, 2), what, dtype)


def replay_check(what: str, ctx: CheckContext) -> Verdict:
    """Batched vs serial ``what`` (log_probs, prev_sample_means) or replay_determinism on the real DiT, cfg 2."""
    if what not in GPU_CHECKS:
        raise ValueError(f"what must be one of {GPU_CHECKS}, got {what!r}")
    args = (str(ctx.checkpoint), ctx.dtype, str(ctx.device))
    problem = checkpoint_problem(*args, 2)
    if what == "replay_determinism":
        return compare_replay_determinism(problem)
    policy = replay_policy(*args, what)
    verdict = compare_replay(problem, policy, what)
    return verdict.with_metrics(measured_floor=policy.relative_floor, bound=policy.relative_bound)
