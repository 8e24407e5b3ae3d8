"""Example conditions that can tell rows and CFG branches apart, or a refusal naming the field that cannot.

A layout bug moves a row field's rows to the wrong forward rows: another sample's prompt, the other
branch's mask. Batched vs serial, and the pipeline oracle, only see that move when the rows it swaps
hold different values. Two masks that came out equal by chance make a mask bug invisible. So the
harness refuses example conditions in which a row field repeats a row:

- within a branch, the rows of every row field are pairwise different (one per sample);
- a field each branch carries on its own (uncond-first ``negative``, or the 2B rows of a fused
  cond-first field) differs between every row of both branches;
- a fused field of B rows is branch-independent by declaration (it serves both branches): only the
  first rule applies to it.

What every row of a call shares (an image size, position ids) is not a row field: it belongs under
``Conditions.shared``. Each comparison is a module-level function, a seam an ablation can replace.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from harness.replay.conditions import Conditions, Payload, payload_rows, slice_rows

__all__ = ["NotDiscriminating", "branch_groups", "first_repeat", "problems", "require_discriminating",
           "row_key"]


class NotDiscriminating(ValueError):
    """Example conditions in which some row field repeats a row (within or across CFG branches)."""


def row_key(item: Any) -> Any:
    """A hashable identity of one row: a tensor row by dtype, shape and bytes; anything else by repr."""
    if isinstance(item, torch.Tensor):
        row = item.detach().cpu().contiguous().reshape(-1)
        return ("tensor", str(item.dtype), tuple(item.shape), row.view(torch.uint8).numpy().tobytes())
    if isinstance(item, (list, tuple)):
        return (type(item).__name__, tuple(row_key(x) for x in item))
    return ("value", repr(item))


def _rows(value: Payload) -> list[Any]:
    return [value[i] for i in range(payload_rows(value))]


def first_repeat(rows: Sequence[Any]) -> tuple[int, int] | None:
    """The first pair (i, j), i < j, of equal rows, or None when every row differs."""
    seen: dict[Any, int] = {}
    for j, item in enumerate(rows):
        key = row_key(item)
        if key in seen:
            return seen[key], j
        seen[key] = j
    return None


def branch_groups(conditions: Conditions) -> dict[str, list[tuple[str, Payload]]]:
    """Per row field, its rows grouped by the branch that owns them: ``[("cond", rows), ("uncond", rows)]``
    for a per-branch field, ``[("both", rows)]`` for a branch-independent one (B rows of a fused call)."""
    batch, groups = conditions.batch, {}
    for name, value in conditions.rows.items():
        if conditions.negative is not None:
            groups[name] = [("cond", value), ("uncond", conditions.negative.rows[name])]
        elif conditions.cfg_factor == 2 and payload_rows(value, f"field {name!r}") == 2 * batch:
            groups[name] = [("cond", slice_rows(value, 0, batch)), ("uncond", slice_rows(value, batch, 2 * batch))]
        else:
            groups[name] = [("both" if conditions.cfg_factor == 2 else "cond", value)]
    return groups


def problems(conditions: Conditions) -> list[str]:
    """One sentence per row field that repeats a row, naming the field and the rows; empty when none does."""
    found = []
    for name, groups in branch_groups(conditions).items():
        labelled = [(branch, i, row) for branch, value in groups for i, row in enumerate(_rows(value))]
        repeat = first_repeat([row for _, _, row in labelled])
        if repeat is None:
            continue
        (b1, i1, _), (b2, i2, _) = labelled[repeat[0]], labelled[repeat[1]]
        where = (f"rows {i1} and {i2} of the {b1} branch are identical" if b1 == b2 else
                 f"row {i1} of the {b1} branch equals row {i2} of the {b2} branch")
        found.append(f"row field {name!r}: {where}")
    return found


def require_discriminating(conditions: Conditions, owner: str) -> Conditions:
    """``conditions`` unchanged when every row field tells its rows and branches apart; else a
    NotDiscriminating naming each field that does not (and what to do about it)."""
    found = problems(conditions)
    if found:
        raise NotDiscriminating(
            f"{owner}: example conditions do not discriminate rows and CFG branches: {'; '.join(found)}. A layout "
            "bug that moves such a field's rows cannot change any number; draw each row (and each branch) its "
            "own value, or move a value every row shares under Conditions.shared")
    return conditions
