"""Registries of what the paths can drive: replay families, AR backends, VAEs, attention kernels, checkpoint kinds.

An installed package extends the suite without editing it, the way pytest finds plugins: it names a
``register(plugins)`` function under the entry-point group ``fastpath_parity.plugins`` and that function
adds to the registries below. The suite's own families register through the very same door (its
pyproject declares them), so nothing here imports a path at import time.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

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
    entry of the fed path's registry that drives it (a replay family, an AR backend, a VAE).
    """

    name: str
    feeds: str
    class_names: tuple[str, ...]
    source: str
    family: str = ""


class PluginError(RuntimeError):
    """An entry point of the plugin group could not be loaded or failed while registering."""


class Registry(Generic[T]):
    """Named entries of one kind; a failed lookup names what is registered and how to add one."""

    def __init__(self, kind: str, how_to_add: str):
        self.kind = kind
        self.how_to_add = how_to_add
        self._entries: dict[str, T] = {}
        self._origins: dict[str, str] = {}

    def register(self, name: str, entry: T, *, origin: str = "") -> T:
        if not name or not isinstance(name, str):
            raise ValueError(f"a {self.kind} needs a non-empty string name, got {name!r}")
        if name in self._entries and self._entries[name] is not entry:
            raise ValueError(f"{self.kind} {name!r} registered twice ({self._origins[name] or 'unknown origin'} "
                             f"and {origin or 'unknown origin'})")
        self._entries[name] = entry
        self._origins[name] = origin
        return entry

    def get(self, name: str) -> T:
        load_plugins()
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(self.names()) or "none"
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {known}. {self.how_to_add}") from None

    def names(self) -> list[str]:
        load_plugins()
        return sorted(self._entries)

    def items(self) -> Iterator[tuple[str, T]]:
        load_plugins()
        yield from sorted(self._entries.items())

    def origin(self, name: str) -> str:
        self.get(name)
        return self._origins[name]

    def unregister(self, name: str) -> None:
        """Remove an entry (tests of the registry itself use it)."""
        self._entries.pop(name, None)
        self._origins.pop(name, None)

    def __contains__(self, name: object) -> bool:
        load_plugins()
        return name in self._entries


_HOW = f"Add one from an installed package: an entry point in the group {ENTRY_POINT_GROUP!r} naming register(plugins)"
REPLAY_FAMILIES: Registry[Any] = Registry("replay family", _HOW + " that calls plugins.REPLAY_FAMILIES.register.")
AR_BACKENDS: Registry[Any] = Registry("AR backend", _HOW + " that calls plugins.AR_BACKENDS.register.")
VAES: Registry[Any] = Registry("VAE", _HOW + " that calls plugins.VAES.register.")
ATTENTION_KERNELS: Registry[Any] = Registry("attention kernel",
                                            _HOW + " that calls plugins.ATTENTION_KERNELS.register.")
CHECKPOINT_KINDS: Registry[Any] = Registry("checkpoint kind", _HOW + " that calls plugins.CHECKPOINT_KINDS.register.")

_LOADED: set[str] = set()
_LOADING = False


def load_plugins(entry_points: Callable[[], Any] | None = None) -> list[str]:
    """Call every ``register(plugins)`` of the entry-point group once, in name order; returns the names loaded.

    Deterministic (sorted by entry-point name) so every process, spawned ranks included, fills the
    registries the same way. A broken plugin raises PluginError naming its entry point and package.
    """
    global _LOADING
    if _LOADING:  # a plugin's register() may look entries up while it registers
        return []
    found = (entry_points or importlib.metadata.entry_points)(group=ENTRY_POINT_GROUP)
    newly = []
    _LOADING = True
    try:
        import harness.plugins as plugins_module

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
