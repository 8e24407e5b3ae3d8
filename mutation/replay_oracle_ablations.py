"""Ablations only independent references can catch, and the ones the strict fakes make numeric.

The first five break code stock and batched replay share (the SDE log-prob, its std and mean, the
halves the CFG combine receives): parity cannot see them, so only the oracle checks (and the pipeline combine
checks) claim them, and
tests/replay/test_oracles.py asserts the parity checks survive them. The rest break the rollout's
record (caught by pi_old against that record), the cfg_factor duplicate-or-split branch of the tiling
and the fused_uncond cache (caught by the numbers, now that the fake reads the cache), and add drifts
that compound over steps: one in every batched mean (caught by the error-growth checks only), one in the uncond
half of a two-branch forward (only a growth check at cfg 2 can see it).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from fixtures.replay_families import family_ids
from harness.judging.ablation import ablation
from harness.judging.checkid import CheckId
from harness.replay.conditions import slice_rows
from harness.replay.sde import LOG_SQRT_2PI, SDEStep, SDEStrategy, gaussian_log_prob

FLAVOURS = ("flowgrpo", "constant")
ORACLE_LOG_PROB = [str(c) for c in CheckId.grid("replay", ("oracle",), FLAVOURS, ("log_prob_fp64", "log_prob_normal"))]


def _oracle(*whats: str) -> list[str]:
    return [str(check) for check in CheckId.grid("replay", ("oracle",), FLAVOURS, whats)]


# ------------------------------------------------------------------------------ shared: the SDE step


def _std_per_element(std: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    return std.reshape(-1, *([1] * (mean.dim() - 1))).expand_as(mean)


def _log_prob_sign_flipped(prev, mean, std):
    """+(prev - mean)^2 / (2 std^2): the quadratic term's sign flipped."""
    s = _std_per_element(std, mean)
    diff = prev.float() - mean
    element = (diff * diff) / (2.0 * (s * s)) - torch.log(s) - LOG_SQRT_2PI
    return element.mean(dim=tuple(range(1, element.dim())))


ablation(
    "replay.log_prob_sign_flipped", "harness.replay.sde:gaussian_log_prob", _log_prob_sign_flipped,
    kills=ORACLE_LOG_PROB,
    why="the Gaussian log-prob adds the squared residual instead of subtracting it (stock and batched alike)",
    kill_mode="tolerance",
)


def _log_prob_floor_div(prev, mean, std):
    """``prev // mean`` where ``prev - mean`` belongs: a transcription slip that still runs."""
    s = _std_per_element(std, mean)
    diff = prev.float() // mean
    element = -(diff * diff) / (2.0 * (s * s)) - torch.log(s) - LOG_SQRT_2PI
    return element.mean(dim=tuple(range(1, element.dim())))


ablation(
    "replay.log_prob_floor_div", "harness.replay.sde:gaussian_log_prob", _log_prob_floor_div,
    kills=ORACLE_LOG_PROB,
    why="prev.float() // mean instead of prev.float() - mean in the log-prob (passed the whole tier before)",
    kill_mode="tolerance",
)


def _std_times_sqrt2(std_t, sigma, sigma_next):
    return std_t * torch.sqrt(2.0 * (sigma - sigma_next))


ablation(
    "replay.std_off_by_sqrt2", "harness.replay.sde:step_std", _std_times_sqrt2,
    kills=[*_oracle("std", "log_prob_fp64", "log_prob_normal"), "replay.oracle.rollout.draws"],
    why="the transition std is std_t sqrt(-2 dt), sqrt 2 too wide: draws and log-probs use the wrong Gaussian",
    kill_mode="tolerance",
)


def _mean_without_one_minus_sigma(x, v, sigma, sigma_next, std_t):
    """The velocity coefficient loses its (1 - sigma) factor: v (1 + std_t^2 / (2 sigma)) dt."""
    dt = sigma_next - sigma
    var_t = std_t * std_t
    lead = (-1, *([1] * (x.dim() - 1)))
    x_coef = (1.0 + var_t / (2.0 * sigma) * dt).reshape(lead)
    v_coef = ((1.0 + var_t / (2.0 * sigma)) * dt).reshape(lead)
    return x * x_coef + v * v_coef


ablation(
    "replay.mean_drops_one_minus_sigma", "harness.replay.sde:flow_mean", _mean_without_one_minus_sigma,
    kills=_oracle("mean", "log_prob_fp64", "log_prob_normal"),
    why="the SDE mean's velocity coefficient drops its (1 - sigma) factor (a transcription slip of the formula in "
        "docs/contracts.md)",
    kill_mode="tolerance",
)


# --------------------------------------------------------------------------- shared: the CFG combine


def _halves_swapped(original):
    def split_branches(layout, out, rows):
        cond, uncond = original(layout, out, rows)
        return uncond, cond
    return split_branches


ablation(
    "replay.cfg_halves_swapped", "harness.replay.denoiser:split_branches", _halves_swapped, wraps=True,
    kills=["replay.oracle.cfg.fused", "replay.oracle.cfg.uncond_first", *family_ids("cfg2.pipeline_combine")],
    why="the forward's two CFG halves reach the combine swapped (uncond taken as cond): guidance pushes away from "
        "the prompt, in stock and fast alike, whatever combine the family declares or writes",
    kill_mode="tolerance",
)


# ------------------------------------------------------------------------------- the rollout's record


def _score_unrounded_draw(strategy: SDEStrategy, x, v, sigma, sigma_next, sigma_max, *, trajectory_dtype,
                          generator, step_index) -> SDEStep:
    """Records the log-prob of the fp32 draw, then stores the draw rounded to the trajectory dtype."""
    mean, std = strategy.transition(x, v, sigma, sigma_next, sigma_max, step_index=step_index)
    noise = torch.randn(mean.shape, generator=generator, dtype=torch.float32, device=generator.device)
    prev = mean + std.reshape(-1, *([1] * (mean.dim() - 1))) * noise.to(mean.device)
    return SDEStep(prev.to(trajectory_dtype), gaussian_log_prob(prev, mean, std), mean, std)


ablation(
    "replay.rollout_scores_unrounded_draw", "harness.replay.rollout:draw_sde_step", _score_unrounded_draw,
    kills=["replay.cfg2.pi_old_vs_rollout", "replay.uncond_first.pi_old_vs_rollout"],
    why="the rollout records the log-prob of the fp32 draw but stores it in bf16: replay scores another latent",
    kill_mode="tolerance",
)


# ------------------------------------------------------------- tiling: the cfg_factor branch and cache


def _split_skipped(original):
    def tile_field(name, value, repeats, batch, cfg_factor):
        if cfg_factor > 1 and isinstance(value, (torch.Tensor, list, tuple)) and len(value) == batch * cfg_factor:
            return original(name, value, repeats, batch * cfg_factor, 1)  # tiled as one block: [c, u] x S
        return original(name, value, repeats, batch, cfg_factor)
    return tile_field


ablation(
    "replay.cfg_split_skipped", "harness.replay.tiling:tile_field", _split_skipped, wraps=True,
    kills=["replay.cfg2.log_probs", "replay.cfg2.prev_sample_means", "replay.cfg2.list_payloads",
           *family_ids("cfg2.log_probs", "cfg2.prev_sample_means", fused=True), "replay.cfg2.pi_old_vs_rollout",
           "replay.flux.cfg2.pi_old_vs_rollout"],
    why="the cfg_factor branch never splits a 2B field into its branch groups: it is tiled as one block, "
        "[cond, uncond] x S, so the midpoint split mixes branches",
    kill_mode="tolerance",
)


def _cache_refreshed_from_cond(original):
    def tile_all(conditions, repeats):
        tiled = original(conditions, repeats)
        if conditions.fused_uncond is None:
            return tiled
        half = tiled.batch
        cache = {name: slice_rows(tiled.rows[name], 0, half) for name in conditions.fused_uncond}
        return dataclasses.replace(tiled, fused_uncond=cache)
    return tile_all


ablation(
    "replay.fused_uncond_from_cond", "harness.replay.tiling:tile_all", _cache_refreshed_from_cond, wraps=True,
    kills=["replay.tiling.fused_uncond_cleared", "replay.cfg2.log_probs", "replay.cfg2.prev_sample_means",
           "replay.cfg2.pi_old_vs_rollout"],
    why="tiling refreshes the fused_uncond cache instead of clearing it, from the cond half of the tiled rows",
    kill_mode="tolerance",
    modes={"replay.tiling.fused_uncond_cleared": "fact"},
    fact="fused_uncond is None after tiling",
)


# ------------------------------------------------------------------------------ a compounding drift


def _relative_drift(column: int) -> float:
    """1 + 2^(column - 30): below fp32 resolution (an exact no-op) up to column 6, then doubling."""
    return float(torch.tensor(1.0 + math.ldexp(1.0, column - 30), dtype=torch.float32))


def _compounding_drift(original):
    def unstack_step_major(flat, steps, batch):
        out = original(flat, steps, batch)
        factors = torch.tensor([_relative_drift(s) for s in range(steps)], dtype=out.dtype)
        return out * factors.reshape(1, steps, *([1] * (out.dim() - 2)))
    return unstack_step_major


ablation(
    "replay.compounding_drift", "harness.replay.tiling:unstack_step_major", _compounding_drift, wraps=True,
    kills=family_ids("growth.prev_sample_means"),
    why="the batched means drift by a relative 2^(s-30) at stacked step s: invisible up to s = 6, then doubling "
        "each step, yet under the single-step tolerance on every step",
    kill_mode="tolerance",
)


def _row_drift(row: int) -> float:
    """1 + 2^(row - 28) in fp32: exactly 1.0 up to row 4 (every row of one serial step's branch), then doubling."""
    return float(torch.tensor(1.0 + math.ldexp(1.0, row - 28), dtype=torch.float32))


def _uncond_drift(original):
    def split_branches(layout, out, rows):
        cond, uncond = original(layout, out, rows)
        factors = torch.tensor([_row_drift(r) for r in range(int(uncond.shape[0]))], dtype=uncond.dtype)
        return cond, uncond * factors.reshape(-1, *([1] * (uncond.dim() - 1)))
    return split_branches


ablation(
    "replay.uncond_drift", "harness.replay.denoiser:split_branches", _uncond_drift, wraps=True,
    kills=family_ids("cfg2.growth.prev_sample_means"),
    why="the uncond half of a two-branch forward drifts by a relative 2^(r-28) at its row r: nothing at the rows of "
        "one serial step, then doubling along the stacked steps of the batched forward; a forward without CFG never "
        "splits, so only a growth check at cfg 2 sees it",
    kill_mode="tolerance",
)

