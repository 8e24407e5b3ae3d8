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
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from harness.inputs import checkpoints
from harness.judging.checks import CheckContext
from harness.judging.compare import Verdict
from harness.replay.conditions import Conditions
from harness.replay.controls import BatchShapeControl, measure_batch_shape_control
from harness.replay.denoiser import DenoiserAdapter, WrappedAdapter
from harness.replay.families import family_for_class
from harness.replay.judge import compare_replay, compare_replay_determinism
from harness.replay.policies import LocalScaleBound, local_scale_policy
from harness.replay.problem import ReplayProblem, make_problem

__all__ = ["ALSO_FEEDS", "GPU_CHECKS", "DeviceAdapter", "checkpoint_problem", "drives", "replay_check",
           "replay_policy"]

BATCH = 2
GPU_CHECKS = ("log_probs", "prev_sample_means", "replay_determinism")
ALSO_FEEDS = ("replay",)


def drives(checkpoint: checkpoints.Checkpoint) -> bool:
    """Whether replay can drive a checkpoint of another path's kind: a HunyuanImage-3 model whose config.json (read
    as data) names its image forward's latent channels, ``vae["latent_channels"]``."""
    vae = checkpoint.config.get("vae")
    return isinstance(vae, dict) and isinstance(vae.get("latent_channels"), int)


def _to(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
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


@functools.cache
def checkpoint_problem(path: str, dtype: torch.dtype, device: str, cfg: int) -> ReplayProblem:
    """A seeded rollout on the real DiT, driven by the registered family of its model class."""
    checkpoint = checkpoints.detect(path)
    try:
        family = family_for_class(checkpoint.class_name)
    except LookupError as err:
        raise checkpoints.CheckpointError(f"checkpoint {path}: {err}") from None
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
