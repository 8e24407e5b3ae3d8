"""Ablations of the replay path: known bugs re-introduced over its seams, each with the checks it kills.

The first eight are the known bugs of the batched replay (the replay PR's mutation check is the first;
docs/contracts.md); the rest give every guard, tiling fact, row broadcast, family CFG combine and the
discriminating check a bug of their own, so no check is without teeth. Claims on the tiny-model checks are
generated over every registered replay family (an installed one included), each layout bug on the families
whose CFG layout it can break. Numeric bugs are declared "tolerance": the numbers must catch them.
"""

from __future__ import annotations

import dataclasses

import torch

from fixtures import replay_space
from fixtures.replay_families import ROPE_FIELDS, family_ids
from harness.judging.ablation import ablation
from harness.judging.checkid import CheckId
from harness.replay import tiling
from harness.replay.conditions import concat_payloads, payload_rows
from harness.replay.denoiser import guidance_at

FAKE = ("cfg1", "cfg2", "uncond_first")
BOTH_CFGS = ("cfg1.log_probs", "cfg1.prev_sample_means", "cfg2.log_probs", "cfg2.prev_sample_means")
CFG2 = ("cfg2.log_probs", "cfg2.prev_sample_means")


def _ids(cases, *whats) -> list[str]:
    return [str(check) for check in CheckId.grid("replay", ("",), cases, whats)]


def _guard(what: str) -> str:
    return str(CheckId("replay", "", "guard", what))


def _space_points(config: str) -> list[str]:
    """The drawn space points whose config is ``config``: every one of them meets the flag's reading."""
    return [replay_space.check_id(p) for p in replay_space.POINTS if p["config"] == config]


# ---------------------------------------------------------------------------------- the eight


def _step_major_outside(groups, repeats):
    """[cond, uncond, cond, uncond, ...]: step-major outside, the nesting the replay PR guards against."""
    return concat_payloads([group for _ in range(repeats) for group in groups])


ablation(
    "replay.nesting_swapped", "harness.replay.tiling:tile_branches", _step_major_outside,
    kills=["replay.tiling.branch_major", *_ids(["cfg2"], "log_probs", "prev_sample_means"),
           "replay.cfg2.unsorted_targets", "replay.cfg2.list_payloads", *family_ids(*CFG2, fused=True)],
    why="tiling nests step-major outside branch-major, so the midpoint split mixes cond and uncond rows",
    kill_mode="tolerance",
    modes={"replay.tiling.branch_major": "fact"},
    fact="tiled rows are branch-major with step-major insi",
)


def _repeat_interleave(value, repeats):
    """Row r of the result is row r // repeats: each sample repeated in place instead of block repetition."""
    if isinstance(value, torch.Tensor):
        return value.repeat_interleave(repeats, dim=0)
    items = [item for item in value for _ in range(repeats)]
    return items if isinstance(value, list) else tuple(items)


ablation(
    "replay.repeat_interleave", "harness.replay.tiling:repeat_rows", _repeat_interleave,
    kills=["replay.tiling.branch_major", "replay.tiling.rope_cache",
           *_ids(["cfg1", "uncond_first"], "log_probs", "prev_sample_means"), *family_ids(*BOTH_CFGS),
           "replay.gpu.cfg2.log_probs", "replay.gpu.cfg2.prev_sample_means"],
    why="repeat_interleave instead of block repetition: row k*B+b of the stacked batch gets sample (k*B+b)//S",
    kill_mode="tolerance",
    modes={"replay.tiling.branch_major": "fact", "replay.tiling.rope_cache": "fact"},
    fact={
        "replay.tiling.branch_major": "tiled rows are branch-major with step-major insi",
        "replay.tiling.rope_cache": "rope_cache tiled to",
    },
)


def _rope_verbatim(original):
    def tile_field(name, value, repeats, batch, cfg_factor):
        if name in ROPE_FIELDS:
            return value
        return original(name, value, repeats, batch, cfg_factor)
    return tile_field


_ROPE_FAMILIES = family_ids("cfg2.log_probs", rope=True)
ablation(
    "replay.rope_cache_verbatim", "harness.replay.tiling:tile_field", _rope_verbatim, wraps=True,
    kills=["replay.tiling.rope_cache", "replay.tiling.batch_size", "replay.cfg2.log_probs", *_ROPE_FAMILIES],
    why="the per-sample RoPE (rope_cache, or a family's per-row RoPE field) is treated like the old shared (cos, "
        "sin) table and passed through verbatim",
    kill_mode="fact",
    # the harness broadcasts row fields and refuses a count that fits neither B nor the forward: fail closed
    modes={"replay.tiling.batch_size": "raises", "replay.cfg2.log_probs": "raises",
           **dict.fromkeys(_ROPE_FAMILIES, "raises")},
    raises=(ValueError,),
    fact="rope_cache tiled to",
)


def _lists_untiled(original):
    def tile_field(name, value, repeats, batch, cfg_factor):
        if isinstance(value, (list, tuple)):
            return value
        return original(name, value, repeats, batch, cfg_factor)
    return tile_field


ablation(
    "replay.list_payload_untiled", "harness.replay.tiling:tile_field", _lists_untiled, wraps=True,
    kills=["replay.cfg2.list_payloads", "replay.tiling.batch_size", "replay.cfg2.log_probs",
           *family_ids("cfg2.log_probs", lists=True)],
    why="list/tuple payloads (it2i conditional images) are left untiled; only tensors are tiled",
    # an untiled field reaches the harness's row broadcast with B or 2B rows for an S*B batch: a ValueError
    kill_mode="raises",
    raises=(ValueError,),
)


def _keep_fused_uncond(original):
    def tile_all(conditions, repeats):
        return dataclasses.replace(original(conditions, repeats), fused_uncond=conditions.fused_uncond)
    return tile_all


ablation(
    "replay.fused_uncond_kept", "harness.replay.tiling:tile_all", _keep_fused_uncond, wraps=True,
    kills=["replay.tiling.fused_uncond_cleared", "replay.cfg2.log_probs"],
    raises=(ValueError,),
    why="fused_uncond is not cleared after tiling: a stale B-row uncond cache rides on the S*B batch",
    kill_mode="fact",
    modes={"replay.cfg2.log_probs": "raises"},
    fact="fused_uncond is None after tiling and shared fie",
)


def _target0_sigma(sigmas, steps, batch):
    """One sigma scalar (target[0]'s) for every row instead of the per-row vector."""
    return sigmas[steps[0]], sigmas[steps[0] + 1]


ablation(
    "replay.sigma_scalar", "harness.replay.replay:step_sigma_vectors", _target0_sigma,
    kills=["replay.gpu.cfg2.log_probs", "replay.gpu.cfg2.prev_sample_means",
           *_ids(FAKE, "log_probs", "prev_sample_means"), "replay.cfg2.unsorted_targets",
           *family_ids("cfg2.log_probs")],
    why="every stacked row uses target[0]'s sigma, though one batch now mixes different steps",
    kill_mode="tolerance",
)


def _no_transpose(flat, steps, batch):
    """[S*B] -> [S, B] and stop: the transpose to [B, S] is missing."""
    return flat.reshape(steps, batch)


ablation(
    "replay.log_probs_no_transpose", "harness.replay.tiling:reshape_log_probs", _no_transpose,
    kills=[*_ids(FAKE, "log_probs_shape", "log_probs"), "replay.sd3.cfg1.log_probs"],
    why="log-probs reshaped to [S, B] without the transpose to the public [B, S]",
    kill_mode="fact",
    fact={
        "replay.cfg1.log_probs_shape": "log_probs is [B, S] = [",
        "replay.cfg1.log_probs": "log_probs has the serial shape [",
        "replay.cfg2.log_probs_shape": "log_probs is [B, S] = [",
        "replay.cfg2.log_probs": "log_probs has the serial shape [",
        "replay.uncond_first.log_probs_shape": "log_probs is [B, S] = [",
        "replay.uncond_first.log_probs": "log_probs has the serial shape [",
        "replay.sd3.cfg1.log_probs": "log_probs has the serial shape [",
    },
)


ablation(
    "replay.guidance_guard_removed", "harness.replay.guards:guidance_is_constant", lambda guidance, steps: True,
    kills=[_guard("step_varying_guidance"), "replay.cfg2.step_varying_guidance"],
    why="the step-varying-guidance guard is removed: one forward applies target[0]'s scale to every step",
    kill_mode="fact",
    modes={"replay.cfg2.step_varying_guidance": "tolerance"},
    fact="step-varying guidance -> None, no forward",
)


def _ends_only(guidance, steps):
    """The guard reads only the first and last target's scale: a schedule varying in the middle slips through."""
    return guidance_at(guidance, steps[0]) == guidance_at(guidance, steps[-1])


ablation(
    "replay.guidance_guard_ends_only", "harness.replay.guards:guidance_is_constant", _ends_only,
    kills=[_guard("middle_varying_guidance"), *family_ids("guard.middle_varying_guidance")],
    why="a guard comparing the first and last target's scale batches a schedule that differs at a middle target "
        "with one scale",
    kill_mode="fact",
    fact="guidance varying at a middle target only -> None, no forward",
)


def _last_sigma_floored(sigmas, steps, batch):
    """sigma_next floored at 1e-3 'to keep the log-prob finite': only the schedule's last step (sigma_next = 0)
    changes."""
    index = torch.tensor(list(steps), dtype=torch.long, device=sigmas.device).repeat_interleave(batch)
    return sigmas[index], sigmas[index + 1].clamp(min=1e-3)


ablation(
    "replay.last_sigma_floored", "harness.replay.replay:step_sigma_vectors", _last_sigma_floored,
    kills=["replay.cfg2.last_step_targeted"],
    why="a floor on sigma_next moves only the final step (sigma 0 -> 1e-3): only a replay whose targets include "
        "the schedule's last step sees it, and then in that step's column",
    kill_mode="tolerance",
)


# ------------------------------------------------------------------------- guards and tiling facts


def _row_major(flat, steps, batch):
    """[S*B] read as [B, S] directly: right shape, rows and steps scrambled."""
    return flat.reshape(batch, steps)


ablation(
    "replay.log_probs_row_major", "harness.replay.tiling:reshape_log_probs", _row_major,
    kills=[*_ids(FAKE, "log_probs"), "replay.sd3.cfg2.log_probs"],
    why="log-probs reshaped straight to [B, S], which reads the step-major batch in the wrong order",
    kill_mode="tolerance",
)

ablation(
    "replay.flag_ignored", "harness.replay.guards:batching_enabled", lambda config: True,
    kills=[_guard("flag_off"), *_space_points("off")],
    why="the batch_replay_steps flag is ignored: the fast path runs even when a recipe leaves it off",
    kill_mode="fact",
    fact={_guard("flag_off"): "flag off -> None, no forward",
          **{check: "the batched path declines: None, no forward" for check in _space_points("off")}},
)

ablation(
    "replay.flag_misread", "harness.replay.guards:batching_enabled",
    lambda config: bool(getattr(config, "batch_replay", False)),
    kills=[*_ids(FAKE, "returns_result", "forward_count"), "replay.cfg2.log_probs", "replay.sd3.cfg2.log_probs",
           *_space_points("on")],
    why="the flag is read under a misspelt key, so the fast path never runs and serial silently answers",
    kill_mode="fact",
    fact={
        "replay.cfg1.returns_result": "batched replay returns a ReplayResult for the re",
        "replay.cfg1.forward_count": "batched replay ran (flag on, stateless SDE, S >",
        "replay.cfg2.returns_result": "batched replay returns a ReplayResult for the re",
        "replay.cfg2.forward_count": "batched replay ran (flag on, stateless SDE, S >",
        "replay.uncond_first.returns_result": "batched replay returns a ReplayResult for the re",
        "replay.uncond_first.forward_count": "batched replay ran (flag on, stateless SDE, S >",
        "replay.cfg2.log_probs": "batched replay returned a result (no silent fall",
        "replay.sd3.cfg2.log_probs": "batched replay returned a result (no silent fall",
        **{check: "batched replay returned a result (no silent fall" for check in _space_points("on")},
    },
)

ablation(
    "replay.single_step_batched", "harness.replay.guards:enough_steps", lambda steps: True,
    kills=[_guard("single_step")],
    why="the S <= 1 guard is removed: a single step is pushed through the batched path",
    kill_mode="fact",
    fact="S == 1 -> None, no forward",
)

ablation(
    "replay.stateful_solver_accepted", "harness.replay.guards:is_stateless_sde", lambda strategy: True,
    kills=[_guard("stateful_solver")],
    raises=(ValueError,),
    why="the stateless-SDE guard accepts a multistep solver, which needs step_index and history",
    kill_mode="raises",
)

ablation(
    "replay.repeats_unchecked", "harness.replay.tiling:check_repeats", lambda repeats: None,
    kills=["replay.tiling.repeats_zero", "replay.tiling.repeats_negative"],
    why="repeats <= 0 is not rejected: 0 empties every field, -1 fails deep inside torch",
    kill_mode="fact",
    fact="raises ValueError matching 'repeats must be >",
)


def _no_identity_shortcut(original):
    def tile_conditions(conditions, repeats):
        tiling.check_repeats(repeats)
        return tiling.tile_all(conditions, repeats)
    return tile_conditions


ablation(
    "replay.identity_shortcut_removed", "harness.replay.tiling:tile_conditions", _no_identity_shortcut, wraps=True,
    kills=["replay.tiling.repeats_identity"],
    why="repeats == 1 re-lays-out and copies every field instead of returning the conditions unchanged",
    kill_mode="fact",
    fact="tile_conditions(c",
)


# ------------------------------------------------------- determinism, row broadcasting, family CFG combines


ablation(
    "replay.next_latent_resampled", "harness.replay.replay:stored_next_latents", lambda segment, steps: None,
    kills=[*_ids(FAKE, "replay_determinism", "log_probs"), *family_ids("cfg2.replay_determinism"),
           "replay.gpu.cfg2.replay_determinism"],
    why="the batched step draws a fresh x_(i+1) instead of scoring the stored latent: log-probs of new noise",
    kill_mode="tolerance",
)


def _interleaved_broadcast(name, value, batch, cfg_factor):
    """A B-row field stretched to the forward by repeating each row in place: [a0, a0, a1, a1, ...]."""
    if payload_rows(value) != batch or cfg_factor == 1:
        return value
    return _repeat_interleave(value, cfg_factor)


ablation(
    "replay.broadcast_interleaved", "harness.replay.conditions:broadcast_field", _interleaved_broadcast,
    kills=["replay.cfg2.log_probs", "replay.cfg2.prev_sample_means",
           *family_ids(*CFG2, fused=True, branch_independent=True)],
    why="a branch-independent B-row field reaches a two-branch forward as [a0, a0, a1, a1, ...], not [a; a]",
    kill_mode="tolerance",
)

ablation(
    "replay.adapter_repeats_rows", "harness.replay.conditions:require_rows", lambda owner, name, value, rows: None,
    kills=family_ids("row_count_refused"),
    why="adapters stop refusing a short row field, so a missing broadcast reaches the model (or is repeated)",
    kill_mode="fact",
    fact="before the transformer runs",
)


ablation(
    "replay.norm_rescale_dropped", "harness.replay.cfg:rescale_to_cond_norm", lambda combined, cond, dim: combined,
    kills=family_ids("cfg2.pipeline_combine", rescaled=True),
    why="a true-CFG combine loses its norm rescale (Qwen-Image's, Lumina2's cfg_normalization): the plain combine "
        "overshoots the cond norm",
    kill_mode="tolerance",
)


def _norm_over_tokens(original):
    def rescale_to_cond_norm(combined, cond, dim):
        return original(combined, cond, 1)
    return rescale_to_cond_norm


ablation(
    "replay.norm_over_tokens", "harness.replay.cfg:rescale_to_cond_norm", _norm_over_tokens, wraps=True,
    kills=family_ids("cfg2.pipeline_combine", rescaled=True),
    why="the true-CFG norms are taken over dim 1 (the tokens of packed latents) instead of the family's channel dim",
    kill_mode="tolerance",
)


def _scale_dropped(original):
    def combine_branches(adapter, cond, uncond, guidance_scale):
        return original(adapter, cond, uncond, 1.0)
    return combine_branches


ablation(
    "replay.guidance_scale_dropped", "harness.replay.denoiser:combine_branches", _scale_dropped, wraps=True,
    kills=[*family_ids("cfg2.pipeline_combine"), "replay.oracle.cfg.fused", "replay.oracle.cfg.uncond_first"],
    why="the family's combine never receives g (the old adapter contract): every scale acts as 1, whether the "
        "combine is declared or the adapter's own code",
    kill_mode="tolerance",
)


# ------------------------------------------------------------------------- discriminating conditions


ablation(
    "replay.repeated_rows_accepted", "harness.replay.discriminating:first_repeat", lambda rows: None,
    kills=family_ids("conditions_discriminate"),
    why="the discriminating check never finds a repeated row: two equal masks pass, and a mask bug hides behind them",
    kill_mode="fact",
    fact="every row field made to repeat a row",
)


def _branches_apart(original):
    def branch_groups(conditions):
        return {name: groups[:1] for name, groups in original(conditions).items()}
    return branch_groups


ablation(
    "replay.branches_compared_apart", "harness.replay.discriminating:branch_groups", _branches_apart, wraps=True,
    kills=family_ids("conditions_discriminate"),
    why="the discriminating check looks at the cond branch only: an uncond row equal to a cond row passes, so a "
        "CFG branch swap on that field changes no number",
    kill_mode="fact",
    fact="every row field made to repeat a row",
)


# ------------------------------------------------------------------- bugs in the stock path the controls share


def _period(rows: torch.Tensor) -> int:
    """The fewest leading rows whose repeats make up ``rows`` (the B samples of a branch tiled over S steps)."""
    count = int(rows.shape[0])
    return next(p for p in range(1, count + 1)
                if count % p == 0 and torch.equal(rows, rows[:p].repeat(count // p, *([1] * (rows.dim() - 1)))))


def _pooled_repeated(original):
    def forward(self, hidden: torch.Tensor, timestep: torch.Tensor, conditions):
        """SD3's pooled projections kept as one serial forward's rows, ``[uncond_B; cond_B]``, and filled to the
        forward's row count with ``repeat``: right at cfg x B rows, interleaved wrong once S steps are stacked."""
        pooled = conditions.rows["pooled_projections"]
        half = int(hidden.shape[0]) // 2
        batch = _period(pooled[:half])
        block = torch.cat([pooled[:batch], pooled[half:half + batch]])
        repeated = block.repeat(int(hidden.shape[0]) // block.shape[0], 1)
        return original(self, hidden, timestep,
                        dataclasses.replace(conditions, rows={**conditions.rows, "pooled_projections": repeated}))
    return forward


ablation(
    "replay.sd3_pooled_repeated", "harness.replay.families.sd3:SD3Adapter.forward", _pooled_repeated, wraps=True,
    kills=[f"replay.sd3.cfg2.{what}" for what in ("log_probs", "prev_sample_means")],
    why="the family adapter keeps a per-row field as one serial forward's block and expands it with repeat: right "
        "at the serial shape only, in code stock and fast share. The batch-shape control runs that adapter at the "
        "fast path's shape and measures the bug as its floor (the numbers pass at margin 0.25); the floor lies "
        "orders above the ceiling rounding allows",
    kill_mode="fact", fact="the stock path itself depends on the batch composition", stock=True,
)
