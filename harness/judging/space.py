"""Each path's inputs as typed axes, and the point of that space every check feeds the implementation under test.

An implementation can be wrong for one class of input only (one CFG layout, gather-to-one, a guidance schedule).
So every path names the axes its inputs vary along (``AXES``), and a catalogue states, next to its registrations,
where each check sits on them (``at(pattern, **values)``, merged over every matching pattern, the most specific
last). A point answers two questions a conformance run asks of every check: which implementation drives it (the
path's *subject* axis: a replay family, an ar model, a VAE) and whether it feeds an input class that
implementation declares it does not support (``harness.plugins.declarations``). ``--parity-list`` prints it.

An axis with ``values`` is closed (its values are written here); a subject axis is open: its values are whatever
the catalogue's checks name (the registered families, models and VAEs, installed ones included).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass

from harness.paths import path_of

__all__ = ["AXES", "Axis", "at", "axis", "describe", "forget", "point", "subject_axis", "values_named"]


@dataclass(frozen=True)
class Axis:
    """One way a path's inputs vary. ``subject``: the axis that says what a check drives (one per path)."""

    name: str
    doc: str
    values: tuple[str, ...] = ()  # () for an open axis: the values the catalogue's points name
    subject: bool = False

    def admits(self, value: str) -> bool:
        return not self.values or value in self.values


def _axes(*axes: Axis) -> dict[str, Axis]:
    return {a.name: a for a in axes}


AXES: dict[str, dict[str, Axis]] = {
    "replay": _axes(
        Axis("family", "the replay family whose model and adapter the check drives (fake: the fake-kernel "
                       "denoiser)", subject=True),
        Axis("cfg_layout", "how the CFG branches reach the model: uncond_first ([uncond; cond], built by the step) "
                           "or fused_cond_first (conditions arrive [cond_B; uncond_B])",
             ("uncond_first", "fused_cond_first")),
        Axis("combine", "the CFG combine the family's pipeline applies"),
        Axis("cfg", "CFG factor: 1 (no guidance batch) or 2", ("1", "2")),
        Axis("guidance", "how the guidance arrives: one scale (a float) or a per-step schedule (a sequence)",
             ("scale", "schedule")),
        Axis("payload", "how the row fields are carried: tensors only, or list/tuple payloads", ("tensor", "list")),
    ),
    "ar": _axes(
        Axis("model", "the tiny model (and its backend) the rollout runs on", subject=True),
        Axis("padding_side", "how the batch is padded: right (training's layout) or left (generate's)",
             ("right", "left")),
    ),
    "decode": _axes(
        Axis("vae", "the VAE family whose tiny model is decoded", subject=True),
        Axis("transport", "how decoded pieces reach the ranks: all_gather (every rank) or gather (to one rank)",
             ("all_gather", "gather")),
        Axis("slicing", "the VAE's use_slicing: one decode per video of the batch", ("off", "on")),
    ),
    "attention": _axes(
        Axis("dtype", "the dtype of query, key and value", ("float32", "bfloat16")),
    ),
}

_POINTS: list[tuple[str, dict[str, str]]] = []


def axis(path: str, name: str) -> Axis:
    """The axis ``name`` of ``path``; an unknown one is a KeyError naming the path's axes."""
    try:
        return AXES[path][name]
    except KeyError:
        known = ", ".join(AXES.get(path, {})) or "none"
        raise KeyError(f"{path} has no input axis {name!r}; its axes: {known}") from None


def subject_axis(path: str) -> Axis | None:
    return next((a for a in AXES.get(path, {}).values() if a.subject), None)


def at(pattern: str, **values: str) -> None:
    """State where the checks matching ``pattern`` (an id or an fnmatch pattern) sit: axis name -> value.

    Declared beside the registrations; a pattern is merged with every other that matches a check, the longer
    (more specific) pattern winning per axis. An axis the pattern's path does not have, or a value a closed axis
    does not admit, is an error at import.
    """
    path = path_of(pattern)
    for name, value in values.items():
        found = axis(path, name)
        if not isinstance(value, str) or not found.admits(value):
            raise ValueError(f"space.at({pattern!r}): {path} axis {name!r} takes one of {list(found.values)}, "
                             f"got {value!r}")
    _POINTS.append((pattern, dict(values)))


def point(check_id: str) -> dict[str, str]:
    """Where ``check_id`` sits: every axis some matching pattern names, the most specific pattern winning."""
    matching = [(pattern, values) for pattern, values in _POINTS
                if pattern == check_id or fnmatch.fnmatchcase(check_id, pattern)]
    merged: dict[str, str] = {}
    for _, values in sorted(matching, key=lambda item: len(item[0])):
        merged.update(values)
    order = list(AXES.get(path_of(check_id), {}))
    return dict(sorted(merged.items(), key=lambda item: order.index(item[0])))


def values_named(path: str, name: str, check_ids: list[str]) -> list[str]:
    """Every value of axis ``name`` the points of ``check_ids`` (of ``path``) name, sorted; a closed axis's own."""
    found = axis(path, name)
    named = {point(check_id).get(name) for check_id in check_ids if path_of(check_id) == path}
    return sorted(set(found.values) | {value for value in named if value is not None})


def describe(values: Mapping[str, str]) -> str:
    """``family=sd3,cfg=2`` in the path's axis order: how reports and ``--parity-list`` print a point."""
    return ",".join(f"{name}={value}" for name, value in values.items())


def forget(prefix: str) -> None:
    """Drop the points declared for patterns starting with ``prefix`` (the machinery's own tests declare demos)."""
    _POINTS[:] = [(pattern, values) for pattern, values in _POINTS if not pattern.startswith(prefix)]
