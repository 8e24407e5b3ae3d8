"""``--parity-list``: one line per check, with where it lives, its policy, its stated floor, its point in the path's
input space, its killers and whether a conformance run judges it."""

from __future__ import annotations

import fnmatch
import functools
from typing import Any

from harness.judging import ablation as ablation_mod
from harness.judging import checks, floors, space
from harness.plugins.conformance_run import conformance_mark

__all__ = ["parity_list"]

def parity_list(pattern: str = "*") -> list[str]:
    """One line per check whose id matches ``pattern``: id, module:qualname, tier, policy, killers."""
    killers: dict[str, list[str]] = {}
    for item in ablation_mod.all_ablations():
        for check_id in item.kills:
            killers.setdefault(check_id, []).append(f"{item.name} ({item.mode_for(check_id)})")
    lines = []
    for check in sorted(checks.all_checks(), key=lambda c: c.id):
        if not fnmatch.fnmatchcase(check.id, pattern):
            continue
        policy = check.policy  # a check that declares its policy up front (at registration) shows it here
        fields = [check.id, check.where or "?", f"tier={check.tier}"]
        bound = _bound_arguments(check.fn)
        if bound:
            fields.append(f"args={bound}")
        if policy:
            fields.append(f"policy={policy}")
        stated = floors.stated_for(check.id)
        if stated:
            fields.append(f"floor={stated}")
        where = space.point(check.id)  # its place in the path's input space (harness.judging.space)
        if where:
            fields.append(f"point={space.describe(where)}")
        fields.append("killers=" + (", ".join(sorted(killers.get(check.id, []))) or "none"))
        fields.append(conformance_mark(check))
        lines.append("  ".join(fields))
    return lines


def _bound_arguments(fn: Any) -> str:
    """What a ``functools.partial`` check binds (one function computes several ids), as call arguments."""
    if not isinstance(fn, functools.partial):
        return ""
    def short(value: Any) -> str:  # a case object shows by its name, not its whole repr
        name = getattr(value, "name", None)
        return f"{type(value).__name__}({name!r})" if isinstance(name, str) and not isinstance(value, str) \
            else repr(value)

    shown = [short(a) for a in fn.args] + [f"{k}={short(v)}" for k, v in fn.keywords.items()]
    return ", ".join(shown)
