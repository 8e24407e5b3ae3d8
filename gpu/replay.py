"""GPU tier of replay: a real diffusers DiT, batched-step replay vs the serial loop, fp32 and bf16.

fp32 is judged against the model's measured batch-shape floor (serial replay at B rows vs the same
rows inside an S x larger batch); bf16 by ``noise_floor`` against that same control, since bf16 GEMMs
round differently at every batch shape. The pi_old anchor replayed twice through the batched path
must give ratio exactly 1 in either dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from fixtures.replay_cases import make_problem
from fixtures.replay_models import FluxAdapter, SD3Adapter
from harness import checkpoints
from harness.checks import CheckContext
from harness.compare import Policy, Verdict, noise_floor
from harness.replay.conditions import Conditions
from harness.replay.denoiser import DenoiserAdapter
from harness.replay.parity import ReplayProblem, batch_shape_floor, compare_pi_old_ratio, compare_replay, floor_policy

__all__ = ["DeviceAdapter", "checkpoint_problem", "replay_check", "replay_policy"]

BATCH = 2
FP32_FLOOR_MULTIPLE = 4.0  # as the CPU tier: 4 x the measured floor
FP32_MINIMUM = 1e-6  # a few fp32 ULPs at the scale of log-probs and means
BF16_K = 2.0  # bf16: at most 2 x the error the batch shape alone causes
BF16_FLOOR = 2**-8  # one bf16 ULP at 1.0: the rounding of the stored trajectory itself


def _to(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device, dtype) for v in value)
    return value


class DeviceAdapter(DenoiserAdapter):
    """Runs an adapter's forward on the model's device and dtype; replay math stays fp32 on the CPU.

    Only the transformer call moves, so stock and fast replay differ in nothing but the batch shape.
    """

    def __init__(self, inner: DenoiserAdapter, device: torch.device, dtype: torch.dtype):
        self.inner, self.device, self.dtype = inner, device, dtype
        self.cfg_layout = inner.cfg_layout
        self.module = inner.module

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        return self.inner.timestep(sigma)

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
    return checkpoints.load_model(checkpoints.detect(path), dtype, device)


@functools.cache
def checkpoint_problem(path: str, dtype: torch.dtype, device: str, cfg: int) -> ReplayProblem:
    """A seeded rollout on the real DiT (CFG in the model family's own layout)."""
    checkpoint = checkpoints.detect(path)
    model = _model(path, dtype, device)
    if checkpoint.class_name == "SD3Transformer2DModel":
        inner: DenoiserAdapter = SD3Adapter(model)
    elif checkpoint.class_name == "FluxTransformer2DModel":
        inner = FluxAdapter(model)
    else:
        raise checkpoints.CheckpointError(f"checkpoint {path}: no replay adapter for {checkpoint.class_name}")
    adapter = DeviceAdapter(inner, torch.device(device), dtype)
    conditions = inner.conditions(BATCH, cfg, torch.Generator().manual_seed(100 + cfg))
    return make_problem(f"{checkpoint.name}.cfg{cfg}", adapter, conditions, seed=cfg,
                        latent_shape=inner.latent_shape)


def replay_policy(problem: ReplayProblem, dtype: torch.dtype, what: str) -> Policy:
    """fp32: close() at 4 x the measured floor; bf16: noise_floor against the batch-shape control."""
    floor = batch_shape_floor(problem)[what]
    if dtype == torch.float32:
        return floor_policy(floor, multiple=FP32_FLOOR_MULTIPLE, minimum=FP32_MINIMUM, what=what)
    return noise_floor(floor, k=BF16_K, floor=BF16_FLOOR,
                       reason=f"{dtype} control: serial replay at B rows vs inside an S x larger batch")


def replay_check(check_id: str, what: str, ctx: CheckContext) -> Verdict:
    """Batched vs serial ``what`` (log_probs, prev_sample_means or pi_old_ratio) on the real DiT, cfg 2."""
    problem = checkpoint_problem(str(ctx.checkpoint), ctx.dtype, str(ctx.device), 2)
    if what == "pi_old_ratio":
        return compare_pi_old_ratio(problem, replay_policy(problem, ctx.dtype, "log_probs"), check_id)
    return compare_replay(problem, replay_policy(problem, ctx.dtype, what), check_id, what)
