"""One registry type for every named catalogue the suite keeps, and one reader of ``"module:attr"`` references.

Checks, ablations, plugin entries (replay families, AR backends, VAEs, kernels, checkpoint kinds), not-judged
declarations and the contexts a distributed task carries are all ``Registry`` objects at module level: an entry
is added once under a unique name (a second, different entry under the same name is an error naming both
origins), an unknown name is an error naming the kind and what is registered, and ``snapshot``/``restore`` let an
all-or-nothing load put a registry back as it was. This module imports nothing from the suite, so every layer,
the process layer included, may use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

__all__ = ["Registry", "import_ref", "load_ref", "split_ref"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Named entries of one kind, in registration order.

    ``before_lookup`` runs before every read (the plugin registries load their entry points there), and
    ``how_to_add`` ends the error of a failed lookup. ``list_known`` names the registered entries in that
    error; a large registry says how many there are instead.
    """

    def __init__(self, kind: str, *, how_to_add: str = "", before_lookup: Callable[[], object] | None = None,
                 list_known: bool = True):
        self.kind = kind
        self.how_to_add = how_to_add
        self._before = before_lookup
        self._list_known = list_known
        self._entries: dict[str, T] = {}
        self._origins: dict[str, str] = {}

    def _ready(self) -> None:
        if self._before is not None:
            self._before()

    def register(self, name: str, entry: T, *, origin: str = "") -> T:
        """Add ``entry`` under ``name``; the very same entry again is a no-op, a different one an error."""
        if not name or not isinstance(name, str):
            raise ValueError(f"a {self.kind} needs a non-empty string name, got {name!r}")
        if name in self._entries and self._entries[name] is not entry:
            raise ValueError(f"{self.kind} {name!r} registered twice ({self._origins[name] or 'unknown origin'} "
                             f"and {origin or 'unknown origin'})")
        self._entries[name] = entry
        self._origins[name] = origin
        return entry

    def get(self, name: str) -> T:
        self._ready()
        try:
            return self._entries[name]
        except KeyError:
            if self._list_known:
                known = ", ".join(sorted(self._entries)) or "none"
            else:
                known = f"{len(self._entries)} {self.kind}s"
            tail = f". {self.how_to_add}" if self.how_to_add else ""
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {known}{tail}") from None

    def names(self) -> list[str]:
        """Every name, sorted."""
        self._ready()
        return sorted(self._entries)

    def items(self) -> Iterator[tuple[str, T]]:
        """Every (name, entry), sorted by name."""
        self._ready()
        yield from sorted(self._entries.items())

    def values(self) -> list[T]:
        """Every entry in registration order (the order a catalogue was written in)."""
        self._ready()
        return list(self._entries.values())

    def origin(self, name: str) -> str:
        self.get(name)
        return self._origins[name]

    def unregister(self, name: str) -> None:
        """Remove an entry (tests of a registry use it)."""
        self._entries.pop(name, None)
        self._origins.pop(name, None)

    def forget(self, prefix: str) -> None:
        """Remove every entry whose name starts with ``prefix`` (the machinery's own tests register demos)."""
        for name in [n for n in self._entries if n.startswith(prefix)]:
            self.unregister(name)

    def snapshot(self) -> tuple[dict[str, T], dict[str, str]]:
        """A copy to ``restore`` after a load that failed half-way."""
        return dict(self._entries), dict(self._origins)

    def restore(self, saved: tuple[dict[str, T], dict[str, str]]) -> None:
        self._entries, self._origins = dict(saved[0]), dict(saved[1])

    def __contains__(self, name: object) -> bool:
        self._ready()
        return name in self._entries

    def __len__(self) -> int:
        self._ready()
        return len(self._entries)


def split_ref(ref: str, what: str = "reference", shape: str = "attribute") -> tuple[str, str]:
    """``"package.module:attr.path"`` -> (module name, attribute path); anything else is an error naming ``what``
    and the shape expected (``'package.module:<shape>'``)."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {ref!r} must read 'package.module:{shape}'")
    return module_name, attr


def import_ref(ref: str, what: str = "reference", shape: str = "attribute") -> tuple[Any, str]:
    """Import the module of ``"package.module:a.b"`` and walk to the owner of the last attribute.

    Returns (owner, last attribute name) so a caller can read or patch it (whether the last attribute exists
    is the caller's to judge); a module that cannot be imported or an owner that does not exist is a
    ValueError naming ``what`` and the reference.
    """
    module_name, attr = split_ref(ref, what, shape)
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{what} {ref!r}: module {module_name!r} cannot be imported ({err})") from err
    *parents, leaf = attr.split(".")
    for part in parents:
        if not hasattr(owner, part):
            raise ValueError(f"{what} {ref!r}: {module_name} has no attribute {attr!r}")
        owner = getattr(owner, part)
    return owner, leaf


def load_ref(ref: str, what: str = "reference", shape: str = "attribute") -> Any:
    """The object ``"package.module:a.b"`` names; a missing one is a ValueError naming ``what`` and the reference."""
    owner, leaf = import_ref(ref, what, shape)
    if not hasattr(owner, leaf):
        raise ValueError(f"{what} {ref!r}: {split_ref(ref)[0]} has no attribute {split_ref(ref)[1]!r}")
    return getattr(owner, leaf)
