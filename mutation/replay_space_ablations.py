"""Ablations that only an input class of the replay space (``fixtures.replay_space``) can see: each bug re-creates
one an implementation shipped while every hand-picked problem passed, and claims exactly the drawn points of the
class that shows it (tests/replay/test_space_classes.py shows a point outside the class passing under it).
"""

from __future__ import annotations

from typing import Any

import torch

from fixtures import replay_space
from harness.judging.ablation import ablation
from harness.replay import tiling
from harness.replay.denoiser import WrappedAdapter, predict_velocity
from harness.replay.guards import ReplayConfig


def _claims(**values: tuple[str, ...]) -> list[str]:
    """The drawn points whose values lie in ``values`` (axis -> values), the batched path on."""
    return [replay_space.check_id(p) for p in replay_space.POINTS
            if p["config"] == "on" and all(p[axis] in wanted for axis, wanted in values.items())]


def _missing_config_is_on(config: ReplayConfig | None) -> ReplayConfig:
    return config if config is not None else ReplayConfig(batch_replay_steps=True)


ablation(
    "replay.missing_config_batches", "harness.replay.guards:resolve_config", _missing_config_is_on,
    kills=[replay_space.check_id(p) for p in replay_space.POINTS if p["config"] == "none"],
    why="a replay handed no config at all batches anyway (the switch read as on when absent): the caller never asked "
        "for the fast path, whose guard must leave the serial loop in charge",
    kill_mode="fact",
    fact="the batched path declines",
)


class _PredictionAsVelocity(WrappedAdapter):
    """The family's adapter with its velocity transform forgotten: the scheduler steps on the combined prediction."""

    def forward(self, hidden: torch.Tensor, timestep: torch.Tensor, conditions: Any) -> torch.Tensor:
        return self.inner.forward(hidden, timestep, conditions)

    def velocity(self, prediction: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return prediction


def _velocity_transform_dropped(adapter: Any, x: torch.Tensor, sigma: torch.Tensor, tiled: Any,
                                guidance_scale: float | None) -> torch.Tensor:
    return predict_velocity(_PredictionAsVelocity(adapter), x, sigma, tiled, guidance_scale)


ablation(
    "replay.velocity_transform_dropped", "harness.replay.replay:batched_velocity", _velocity_transform_dropped,
    kills=_claims(velocity=("negate",)),
    why="the batched path steps on the combined model output and never applies the family's velocity transform "
        "(a pipeline that negates its prediction): identical wherever the transform is the identity",
    kill_mode="tolerance",
)


def _next_latents_as_bf16(segment: Any, steps: Any) -> torch.Tensor:
    return tiling.stack_step_major([segment.latent_at(step + 1) for step in steps]).to(torch.bfloat16)


ablation(
    "replay.next_latents_rounded_to_bf16", "harness.replay.replay:stored_next_latents", _next_latents_as_bf16,
    kills=_claims(trajectory=("fp16", "fp32")),
    why="x_(t+1) rounded to bf16 by hard-coding, not kept in the trajectory's own dtype: invisible on a bf16 "
        "trajectory, a log-prob of another sample on an fp16 or fp32 one",
    kill_mode="tolerance",
)
