"""Tiling conditions and stacking latents for the batched-step replay (docs/contracts.md, replay).

The batched forward stacks S target steps on the batch dim, step-major: rows k*B..(k+1)*B-1 are the
B samples at target[k]. Conditions must follow the same layout inside each CFG branch, and in the
fused cond-first layout the branches stay outside: ``[cond_s0, ..., cond_s{S-1}, uncond_s0, ...]``,
because the model splits its batch at the midpoint. Getting the nesting backwards is silent.

Each function here is a seam: an ablation replaces it from outside to re-introduce one known bug.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from harness.replay.conditions import Conditions, Payload, concat_payloads, payload_rows, slice_rows

__all__ = [
    "branch_groups",
    "check_repeats",
    "repeat_rows",
    "reshape_log_probs",
    "stack_step_major",
    "tile_all",
    "tile_branches",
    "tile_conditions",
    "tile_field",
    "unstack_step_major",
]


def check_repeats(repeats: int) -> None:
    """Reject a repeat count that is not a positive int (0 would silently empty every field)."""
    if isinstance(repeats, bool) or not isinstance(repeats, int):
        raise TypeError(f"repeats must be an int (the number of stacked steps S), got {type(repeats).__name__}")
    if repeats <= 0:
        raise ValueError(f"repeats must be >= 1 (the number of stacked steps S), got {repeats}")


def repeat_rows(value: Payload, repeats: int) -> Payload:
    """Block repetition: row r of the result is row r mod N of ``value`` (tensor or list/tuple)."""
    if isinstance(value, torch.Tensor):
        return value.repeat(repeats, *([1] * (value.dim() - 1)))
    return value * repeats


def tile_branches(groups: Sequence[Payload], repeats: int) -> Payload:
    """Branch-major outside, step-major inside: ``[g0 x repeats, g1 x repeats, ...]``."""
    return concat_payloads([repeat_rows(group, repeats) for group in groups])


def branch_groups(name: str, value: Payload, batch: int, cfg_factor: int) -> list[Payload]:
    """One ``batch``-row group per CFG branch: a field of ``cfg_factor * batch`` rows is split into its
    branches; a field of ``batch`` rows is branch-independent and serves every branch (duplicated)."""
    rows = payload_rows(value, f"field {name!r}")
    if rows == batch * cfg_factor:
        return [slice_rows(value, b * batch, (b + 1) * batch) for b in range(cfg_factor)]
    if rows == batch:
        return [value] * cfg_factor
    raise ValueError(f"field {name!r} has {rows} rows; expected {batch} (one per sample) or "
                     f"{batch * cfg_factor} (cfg_factor={cfg_factor} branches of {batch})")


def tile_field(name: str, value: Payload, repeats: int, batch: int, cfg_factor: int) -> Payload:
    """Tile one row-aligned field to ``cfg_factor * repeats * batch`` rows: its branch groups, each
    repeated ``repeats`` times step-major, branches outside."""
    return tile_branches(branch_groups(name, value, batch, cfg_factor), repeats)


def tile_all(conditions: Conditions, repeats: int) -> Conditions:
    """Tile every row field (and the uncond-first ``negative``), pass shared fields through, clear
    ``fused_uncond`` (a cache of the untiled uncond rows, stale once the batch grows)."""
    rows = {name: tile_field(name, value, repeats, conditions.batch, conditions.cfg_factor)
            for name, value in conditions.rows.items()}
    negative = None if conditions.negative is None else tile_all(conditions.negative, repeats)
    return dataclasses.replace(conditions, batch=conditions.batch * repeats, rows=rows, negative=negative,
                               fused_uncond=None)


def tile_conditions(conditions: Conditions, repeats: int) -> Conditions:
    """Conditions for ``repeats`` stacked steps; ``repeats == 1`` returns ``conditions`` itself."""
    check_repeats(repeats)
    if repeats == 1:
        return conditions
    return tile_all(conditions, repeats)


def stack_step_major(per_step: Sequence[torch.Tensor]) -> torch.Tensor:
    """S tensors ``[B, ...]`` -> ``[S*B, ...]``, rows k*B..(k+1)*B-1 from step k."""
    if not per_step:
        raise ValueError("stack_step_major needs at least one step")
    return torch.cat(list(per_step), dim=0)


def unstack_step_major(flat: torch.Tensor, steps: int, batch: int) -> torch.Tensor:
    """``[S*B, ...]`` step-major -> ``[B, S, ...]`` (column s is target[s])."""
    return flat.reshape(steps, batch, *flat.shape[1:]).transpose(0, 1).contiguous()


def reshape_log_probs(flat: torch.Tensor, steps: int, batch: int) -> torch.Tensor:
    """``[S*B]`` -> ``[S, B]`` -> ``[B, S]``."""
    return flat.reshape(steps, batch).transpose(0, 1).contiguous()
