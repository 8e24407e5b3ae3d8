"""Registries of what the paths can drive: replay families, AR backends, VAEs, attention kernels, checkpoint kinds.

An installed package extends the suite without editing it, the way pytest finds plugins: it names a
``register(plugins)`` function under the entry-point group ``fastpath_parity.plugins`` and that function
adds to the registries below. The suite's own families register through the very same door (its
pyproject declares them), so nothing here imports a path at import time.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from harness import registry

__all__ = [
    "AR_BACKENDS",
    "ATTENTION_KERNELS",
    "CHECKPOINT_KINDS",
    "ENTRY_POINT_GROUP",
    "REPLAY_FAMILIES",
    "VAES",
    "CheckpointKind",
    "PluginError",
    "Registry",
    "load_plugins",
]

ENTRY_POINT_GROUP = "fastpath_parity.plugins"
T = TypeVar("T")


@dataclass(frozen=True)
class CheckpointKind:
    """How the gpu tier recognises a checkpoint directory and which path (and registry entry) it feeds.

    ``class_names`` are matched against a diffusers config's ``_class_name`` (source "diffusers") or a
    transformers config's ``architectures`` (sources "transformers" and "remote_code"); ``family`` names the
    entry of the fed path's registry that drives it (a replay family, an AR backend, a VAE). ``tiny`` writes a
    tiny random-init checkpoint of this kind into a directory, so the gpu tier's CPU dry run and its kind test
    cover it (a replay family's ``tiny_model`` serves when it is None).
    """

    name: str
    feeds: str
    class_names: tuple[str, ...]
    source: str
    family: str = ""
    tiny: Callable[[Path], None] | None = None


class PluginError(RuntimeError):
    """An entry point of the plugin group could not be loaded or failed while registering."""


class Registry(registry.Registry[T]):
    """Named entries of one kind that installed packages add to: every lookup loads the entry points first."""

    def __init__(self, kind: str, how_to_add: str):
        super().__init__(kind, how_to_add=how_to_add, before_lookup=lambda: load_plugins())


_HOW = f"Add one from an installed package: an entry point in the group {ENTRY_POINT_GROUP!r} naming register(plugins)"
REPLAY_FAMILIES: Registry[Any] = Registry("replay family", _HOW + " that calls plugins.REPLAY_FAMILIES.register.")
AR_BACKENDS: Registry[Any] = Registry("AR backend", _HOW + " that calls plugins.AR_BACKENDS.register.")
VAES: Registry[Any] = Registry("VAE", _HOW + " that calls plugins.VAES.register.")
ATTENTION_KERNELS: Registry[Any] = Registry("attention kernel",
                                            _HOW + " that calls plugins.ATTENTION_KERNELS.register.")
CHECKPOINT_KINDS: Registry[Any] = Registry("checkpoint kind", _HOW + " that calls plugins.CHECKPOINT_KINDS.register.")

_LOADED: set[str] = set()
_LOADING = False


@functools.cache
def _installed() -> tuple[Any, ...]:
    """The group's installed entry points, scanned once per process (a scan reads every dist-info: ~17 ms)."""
    return tuple(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def load_plugins(entry_points: Callable[[], Any] | None = None) -> list[str]:
    """Call every ``register(plugins)`` of the entry-point group once, in name order; returns the names loaded.

    Deterministic (sorted by entry-point name) so every process, spawned ranks included, fills the
    registries the same way. A broken plugin raises PluginError naming its entry point and package.
    """
    global _LOADING
    if _LOADING:  # a plugin's register() may look entries up while it registers
        return []
    found = entry_points(group=ENTRY_POINT_GROUP) if entry_points else _installed()
    newly = []
    _LOADING = True
    try:
        import harness.plugins.entry_points as plugins_module

        for point in sorted(found, key=lambda p: (p.name, p.value)):
            key = f"{point.name}={point.value}"
            if key in _LOADED:
                continue
            dist = getattr(getattr(point, "dist", None), "name", "?")
            try:
                register = point.load()
                register(plugins_module)
            except Exception as err:
                raise PluginError(f"plugin entry point {point.name!r} ({point.value}, package {dist}) failed: "
                                  f"{type(err).__name__}: {err}") from err
            _LOADED.add(key)
            newly.append(point.name)
    finally:
        _LOADING = False
    return newly
