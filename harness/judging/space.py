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
import hashlib
import itertools
import os
import random
import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from allpairspy import AllPairs

from harness.paths import path_of

__all__ = ["AXES", "FULL_SPACE_ENV", "SPACE_MODES", "Axis", "at", "axis", "commit_seed", "covering", "describe",
           "forget", "label", "point", "space_mode", "subject_axis", "values_named"]


@dataclass(frozen=True)
class Axis:
    """One way a path's inputs vary. ``subject``: the axis that says what a check drives (one per path)."""

    name: str
    doc: str
    values: tuple[str, ...] = ()  # () for an open axis: the values the catalogue's points name
    subject: bool = False

    def admits(self, value: str) -> bool:
        return not self.values or value in self.values


_PATH_AXES: dict[str, tuple[Axis, ...]] = {
    "replay": (
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
        Axis("trajectory", "the dtype the trajectory's latents are stored in", ("bf16", "fp16", "fp32")),
        Axis("config", "the replay config handed in: the flag on, none at all, or the flag off", ("on", "none", "off")),
        Axis("velocity", "what the family's pipeline does to the combined prediction", ("identity", "negate")),
        Axis("storage", "which latents the segment stores: those replay needs, or every step's", ("sparse", "dense")),
        Axis("steps", "how many target steps one replay stacks", ("s2", "s4")),
        Axis("batch", "samples per replayed segment", ("b1", "b3")),
        Axis("last_step", "whether the schedule's final step (sigma -> 0) is among the targets", ("last", "early")),
    ),
    "ar": (
        Axis("model", "the tiny model (and its backend) the rollout runs on", subject=True),
        Axis("padding_side", "how the batch is padded: right (training's layout) or left (generate's)",
             ("right", "left")),
        Axis("dtype", "the dtype of the model's weights (and so of its logits and KV)", ("float32", "bfloat16")),
        Axis("kernel", "the model's attention: sdpa, or eager (a -inf masked softmax: a query row that admits no key "
                       "is NaN)", ("sdpa", "eager")),
        Axis("eos", "where a row first meets EOS: mid (one row, near the middle of the rollout) or first (a row's "
                    "first sampled token, read from the prefill)", ("mid", "first")),
        Axis("capacity", "the static cache's slots per row: exact (width + new tokens), blocks (whole blocks of 64, "
                         "as a block kernel allocates) or maximum (allocated once at a maximum length and reused)",
             ("exact", "blocks", "maximum")),
    ),
    "decode": (
        Axis("vae", "the VAE family whose tiny model is decoded", subject=True),
        Axis("transport", "how decoded pieces reach the ranks: all_gather (every rank) or gather (to one rank)",
             ("all_gather", "gather")),
        Axis("slicing", "the VAE's use_slicing: one decode per video of the batch", ("off", "on")),
        Axis("overlaps", "the overlaps of a latent frame's tile grid: equal (8 latent pixels wide: [4, 4] px) or "
                         "unequal (9 wide: [4, 2] px), where each seam's own overlap is the only right one",
             ("equal", "unequal")),
        Axis("world", "ranks in the world that decodes", ("w2", "w3", "w4")),
        Axis("clips", "clips of the video against the ranks of the group that decodes it: fewer (idle ranks) or "
                      "more (a rank decodes several)", ("fewer", "more")),
        Axis("groups", "the group handed in: the whole world (one), or two interleaved subgroups of it, each "
                       "decoding its own video at once (two)", ("one", "two")),
        Axis("dtype", "the VAE's dtype, which the decoded video comes back in", ("float32", "bfloat16")),
    ),
    "attention": (
        Axis("dtype", "the dtype of query, key and value", ("float32", "bfloat16")),
        Axis("scale", "the scale the kernel is called with: default (scale=None, meaning 1 / sqrt(D)) or custom "
                      "(an explicit other scale)", ("default", "custom")),
        Axis("batch", "the batch: one row, or two rows whose query, key and value differ", ("b1", "b2")),
        Axis("group", "the GQA group H / Hkv: query head h reads key/value head h // group", ("g1", "g2", "g4")),
        Axis("block", "the KV length: a multiple of the block a tiled kernel works in, or not",
             ("aligned", "unaligned")),
    ),
}
AXES: dict[str, dict[str, Axis]] = {path: {a.name: a for a in axes} for path, axes in _PATH_AXES.items()}

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


# ------------------------------------------------------------------------------------------ covering the space

FULL_SPACE_ENV = "PARITY_SPACE"  # "full": every point of every generated space (the nightly run); else pairwise
SPACE_MODES = ("pairwise", "full")


def space_mode() -> str:
    """``PARITY_SPACE``: ``pairwise`` (unset or empty: the default) or ``full``; anything else is a ValueError
    naming the variable, so a misspelt nightly setting never silently runs the pairwise draw."""
    value = os.environ.get(FULL_SPACE_ENV, "") or "pairwise"
    if value not in SPACE_MODES:
        raise ValueError(f"{FULL_SPACE_ENV}={value!r}: expected one of {', '.join(SPACE_MODES)}")
    return value


def commit_seed(root: Path | None = None) -> int:
    """A per-commit seed: the first 64 bits of the SHA-256 of ``git rev-parse HEAD`` in ``root`` (the suite's
    checkout), so each commit draws its own points and a run of one commit always draws the same; 0 outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root or Path(__file__).resolve().parents[2],
                              capture_output=True, text=True, timeout=30)
        commit = head.stdout.strip() if head.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        commit = ""
    if not re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", commit):
        return 0
    return int(hashlib.sha256(commit.encode()).hexdigest()[:16], 16)


def covering(axes: Mapping[str, Sequence[str]], *, seed: int, extra: int = 0,
             allowed: Callable[[dict[str, str]], bool] | None = None) -> list[dict[str, str]]:
    """Points that hold every pair of values of any two axes at least once (a pairwise covering array, from
    allpairspy, over the points ``allowed`` admits), then ``extra`` more drawn from the whole space with ``seed``;
    with ``PARITY_SPACE=full``, every allowed point. Deterministic for a seed."""
    names = list(axes)
    valid = allowed or (lambda _: True)

    def admits(row: Sequence[str]) -> bool:
        return valid(dict(zip(names[:len(row)], row, strict=True))) if len(row) == len(names) else True

    if space_mode() == "full":
        every = [dict(zip(names, row, strict=True)) for row in itertools.product(*axes.values())]
        return [p for p in every if valid(p)]
    allowed_rows = [row for row in itertools.product(*axes.values()) if valid(dict(zip(names, row, strict=True)))]
    core = [tuple(row) for row in AllPairs([list(v) for v in axes.values()], filter_func=admits)]
    core += _fill_missing_pairs(core, allowed_rows)
    chosen = set(core)
    rest = [row for row in allowed_rows if row not in chosen]
    drawn = random.Random(seed).sample(rest, min(extra, len(rest)))
    return [dict(zip(names, row, strict=True)) for row in [*core, *sorted(drawn)]]


def _pairs_of(row: Sequence[str]) -> set[tuple[int, str, int, str]]:
    return {(i, row[i], j, row[j]) for i, j in itertools.combinations(range(len(row)), 2)}


def _fill_missing_pairs(rows: Sequence[tuple[str, ...]],
                        allowed: Sequence[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """The allowed points that cover the pairs ``rows`` miss, the one covering most of them first: under a
    constraint allpairspy can leave out a pair some allowed point holds."""
    missing = set().union(*map(_pairs_of, allowed)) - set().union(*map(_pairs_of, rows))
    added: list[tuple[str, ...]] = []
    while missing:
        best = max(allowed, key=lambda row: len(_pairs_of(row) & missing))  # the first such in product order
        added.append(best)
        missing -= _pairs_of(best)
    return added


def label(point: Mapping[str, str]) -> str:
    """A point as one id segment: its values in axis order, joined by dashes (``bf16-none-negate-fused``)."""
    return "-".join(point.values())
