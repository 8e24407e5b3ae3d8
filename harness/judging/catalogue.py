"""Which modules make up the check and ablation catalogues, and how they load: whole, once, or not at all.

Claims are validated only after every module has registered (an ablation may claim a check another
module registers), and a load that fails anywhere leaves the registries as they were, so a retry, or a
spawned rank rebuilding the catalogue from scratch, never meets a half registry. The module names are
data here: nothing is imported until ``load()`` runs.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from harness.judging import ablation, checks

__all__ = ["ABLATION_MODULES", "CHECK_MODULES", "load", "loaded", "loads"]

CHECK_MODULES: tuple[str, ...] = (
    "parity.replay_checks",
    "parity.replay_oracle_checks",
    "parity.replay_pipeline_checks",
    "parity.replay_space_checks",
    "parity.ar_checks",
    "parity.ar_left_padded_checks",
    "parity.ar_space_checks",
    "parity.decode_checks",
    "parity.decode_space_checks",
    "parity.attention_checks",
    "parity.attention_space_checks",
    "gpu.checks",
)
ABLATION_MODULES: tuple[str, ...] = (
    "mutation.replay_ablations",
    "mutation.replay_oracle_ablations",
    "mutation.replay_pipeline_ablations",
    "mutation.replay_space_ablations",
    "mutation.ar_ablations",
    "mutation.ar_left_padded_ablations",
    "mutation.decode_ablations",
    "mutation.attention_ablations",
)

_LOADED: set[tuple[str, ...]] = set()
_LOADS: list[tuple[tuple[str, ...], tuple[str, ...]]] = []  # (check modules, ablation modules), in load order


def loads() -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """Every load this process made, in order: another process that repeats them has the same registries (a run
    split over workers builds its report where no test module ran)."""
    return list(_LOADS)


def loaded() -> bool:
    key = CHECK_MODULES + ABLATION_MODULES
    return key in _LOADED and all(name in sys.modules for name in key)


def load(check_modules: Sequence[str] = CHECK_MODULES, ablation_modules: Sequence[str] = ABLATION_MODULES) -> None:
    """Import every catalogue module and validate every claim; idempotent, and all-or-nothing."""
    key = tuple(check_modules) + tuple(ablation_modules)
    if key in _LOADED and all(name in sys.modules for name in key):
        return
    saved_checks = checks.CHECKS.snapshot()
    saved_ablations = ablation.ABLATIONS.snapshot()
    before = set(sys.modules)
    try:
        for name in (*check_modules, *ablation_modules):
            importlib.import_module(name)
        ablation.validate_claims()
    except BaseException:
        checks.CHECKS.restore(saved_checks)
        ablation.ABLATIONS.restore(saved_ablations)
        for name in set(sys.modules) - before:  # a retry must re-run the modules' registrations
            sys.modules.pop(name, None)
        raise
    _LOADED.add(key)
    if (tuple(check_modules), tuple(ablation_modules)) not in _LOADS:
        _LOADS.append((tuple(check_modules), tuple(ablation_modules)))
