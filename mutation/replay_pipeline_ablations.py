"""Ablations only the pipeline oracle can catch: bugs in how an adapter translates a pipeline step, which
stock and batched replay share. Each claims the pipeline oracle of every registered replay family, and the gpu
tier's oracle on a real checkpoint."""

from __future__ import annotations

import torch

from fixtures.replay_families import family_ids, family_names
from harness.judging.ablation import ablation
from harness.judging.checkid import CheckId
from harness.replay.denoiser import FUSED_COND_FIRST, UNCOND_FIRST

# the CPU tier's oracle of every registered family, and the gpu tier's on a real checkpoint's own loop
ORACLE = [*(str(check) for check in CheckId.grid("replay", ("oracle",), ("pipeline",), family_names())),
          "replay.gpu.oracle.pipeline"]


def _units_swapped(original):
    def model_timestep(adapter, sigma: torch.Tensor) -> torch.Tensor:
        """A hook in [0, 1000] answers sigma; a hook in [0, 1] answers 1000 sigma."""
        t = original(adapter, sigma)
        thousands = bool((t.double().abs() > 1.5 * sigma.double().abs()).any())
        return sigma if thousands else sigma * 1000.0
    return model_timestep


ablation(
    "replay.timestep_units_wrong", "harness.replay.denoiser:model_timestep", _units_swapped, wraps=True,
    kills=ORACLE,
    why="the model gets its timestep in the wrong units (sigma where the pipeline passes t in [0, 1000], or "
        "1000 sigma where it passes sigma): stock and batched alike, so every parity check passes",
    kill_mode="tolerance",
)


def _declared_backwards(original):
    def declared_layout(adapter) -> str:
        return UNCOND_FIRST if original(adapter) == FUSED_COND_FIRST else FUSED_COND_FIRST
    return declared_layout


ablation(
    "replay.cfg_order_declared_wrong", "harness.replay.denoiser:declared_layout", _declared_backwards, wraps=True,
    kills=ORACLE,
    why="the CFG order is declared backwards (cond-first rows read as uncond-first, or the reverse): the combine "
        "guides away from the prompt in stock and batched replay alike, the combine check included",
    kill_mode="tolerance",
)


def _sign_flipped(original):
    def model_velocity(adapter, prediction: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return -original(adapter, prediction, x, sigma)
    return model_velocity


ablation(
    "replay.velocity_sign_flipped", "harness.replay.denoiser:model_velocity", _sign_flipped, wraps=True,
    kills=[*ORACLE, *family_ids("cfg2.pipeline_combine")],
    why="the velocity handed to the scheduler has the wrong sign (a pipeline's negation of the model output left "
        "out of the family, or added where the pipeline has none): stock and batched alike step the wrong way",
    kill_mode="fact",
    fact="not a sign flip",
)
