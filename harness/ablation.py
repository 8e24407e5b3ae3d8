"""Ablations: one known bug re-introduced over one seam, with the checks it must make fail.

A seam is a module-level function (``"harness.replay.tiling:tile_conditions"``). Applying an
ablation swaps that attribute from outside and always restores it, so implementation code carries
no test-only flags. Active ablations travel with distributed tasks (harness.dist re-applies them
inside each rank), because ranks forked before the patch would not see it.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from harness import checks

__all__ = ["Ablation", "KillResult", "ablation", "active", "all_ablations", "applied", "drop_inherited", "get",
           "run_under"]


@dataclass(frozen=True)
class Ablation:
    """A named bug (``path.bug``) patched over ``seam`` that must kill every check in ``kills``.

    ``replacement`` is the buggy function; with ``wraps=True`` it is a factory called with the
    original function and returning the buggy one. ``raises`` lists the exception types that
    count as a kill (the crash the bug causes, or harness.dist.WorldTimeout for a hang);
    ``hang_timeout_s`` bounds distributed tasks while it is applied.
    """

    name: str
    seam: str
    replacement: Callable[..., Any]
    kills: tuple[str, ...]
    why: str
    wraps: bool = False
    raises: tuple[type[BaseException], ...] = ()
    hang_timeout_s: float | None = None
    origin: str = field(default="", compare=False)

    @property
    def path(self) -> str:
        return self.name.split(".", 1)[0]

    def resolve(self) -> tuple[Any, str]:
        return resolve_seam(self.seam)

    @contextlib.contextmanager
    def apply(self) -> Iterator[None]:
        owner, attr = self.resolve()
        original = getattr(owner, attr)
        patched = self.replacement(original) if self.wraps else self.replacement
        setattr(owner, attr, patched)
        patch = _Patch(self, owner, attr, original)
        _ACTIVE.append(patch)
        try:
            yield
        finally:
            if patch in _ACTIVE:  # a forked child may have dropped it already
                _ACTIVE.remove(patch)
                setattr(owner, attr, original)


@dataclass(eq=False)
class _Patch:
    """One applied ablation and what its seam held before."""

    item: Ablation
    owner: Any
    attr: str
    original: Any


def drop_inherited() -> list[str]:
    """Undo every applied ablation; a freshly forked rank calls it before its first task.

    A world forked while an ablation is applied (a pool restarting a torn-down world inside a
    kill-matrix check) would otherwise keep that ablation in its ranks for every later task; the
    ablations a task needs travel with the task instead. Returns the names dropped.
    """
    dropped = []
    while _ACTIVE:
        patch = _ACTIVE.pop()
        setattr(patch.owner, patch.attr, patch.original)
        dropped.append(patch.item.name)
    return dropped


def resolve_seam(seam: str) -> tuple[Any, str]:
    """``"pkg.module:function"`` -> (module object, attribute name); unknown seams raise naming them."""
    module_name, sep, attr = seam.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"seam {seam!r} must read 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"seam {seam!r}: module {module_name!r} cannot be imported ({err})") from err
    owner: Any = module
    *parents, leaf = attr.split(".")
    for part in parents:
        if not hasattr(owner, part):
            raise ValueError(f"seam {seam!r}: {module_name} has no attribute path {attr!r}")
        owner = getattr(owner, part)
    if not callable(getattr(owner, leaf, None)):
        raise ValueError(f"seam {seam!r}: {module_name} has no callable {attr!r}")
    return owner, leaf


_ABLATIONS: dict[str, Ablation] = {}
_ACTIVE: list[_Patch] = []


def ablation(name: str, seam: str, replacement: Callable[..., Any], *, kills: Sequence[str], why: str,
             wraps: bool = False, raises: Sequence[type[BaseException]] = (),
             hang_timeout_s: float | None = None) -> Ablation:
    """Register an ablation; unknown check ids or seams fail here, at import, naming them."""
    if "." not in name or not name.islower():
        raise ValueError(f"ablation name {name!r} must read 'path.bug' in lowercase")
    if name in _ABLATIONS:
        raise ValueError(f"ablation {name!r} registered twice")
    if not kills:
        raise ValueError(f"ablation {name!r} names no check to kill")
    unknown = [c for c in kills if not checks.exists(c)]
    if unknown:
        raise ValueError(f"ablation {name!r} claims unknown check ids: {unknown}")
    resolve_seam(seam)
    frame = inspect.stack()[1]
    origin = frame.frame.f_globals.get("__name__", "")
    item = Ablation(name, seam, replacement, tuple(kills), why, wraps, tuple(raises), hang_timeout_s, origin)
    _ABLATIONS[name] = item
    return item


def get(name: str) -> Ablation:
    try:
        return _ABLATIONS[name]
    except KeyError:
        raise KeyError(f"unknown ablation {name!r}") from None


def all_ablations(path: str | None = None) -> list[Ablation]:
    return [a for a in _ABLATIONS.values() if path is None or a.path == path]


def active() -> list[tuple[str, str]]:
    """(name, defining module) of every applied ablation, for re-application inside ranks."""
    return [(p.item.name, p.item.origin) for p in _ACTIVE]


@contextlib.contextmanager
def applied(refs: Sequence[tuple[str, str]]) -> Iterator[None]:
    """Re-apply ablations by reference (inside a rank process)."""
    with contextlib.ExitStack() as stack:
        for name, origin in refs:
            if name not in _ABLATIONS and origin:
                importlib.import_module(origin)
            stack.enter_context(get(name).apply())
        yield


@dataclass(frozen=True)
class KillResult:
    """What one check did under one ablation.

    ``margin`` is the ablated verdict's error / tolerance when a tolerance was exceeded; a kill by a
    required fact (a spy) or by a declared exception has none. ``metrics`` are the ablated verdict's.
    """

    ablation: str
    check: str
    killed: bool
    margin: float | None
    how: str  # "tolerance", "required fact", "raised <Type>", "survived", "wrong exception <Type>"
    detail: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    headline: str = ""  # the ablated verdict's headline metric, e.g. "max_abs=1.9e+04"


def run_under(item: Ablation, check_id: str, ctx: checks.CheckContext) -> KillResult:
    """Run ``check_id`` with ``item`` applied and say whether it was killed, and by how much."""
    previous = ctx.task_timeout_s
    if item.hang_timeout_s is not None:
        ctx.task_timeout_s = item.hang_timeout_s
    try:
        with item.apply():
            verdict = checks.run_check(check_id, ctx)
    except item.raises as err:  # an empty tuple matches nothing
        return KillResult(item.name, check_id, True, None, f"raised {type(err).__name__}", str(err)[:500])
    except Exception as err:  # noqa: BLE001 - an undeclared crash is reported, not a clean kill
        return KillResult(item.name, check_id, False, None, f"wrong exception {type(err).__name__}", str(err)[:500])
    finally:
        ctx.task_timeout_s = previous
    value = verdict.headline_value
    headline = f"{verdict.headline}={value:.3e}" if isinstance(value, float) else (
        f"{verdict.headline}={value}" if verdict.headline else "")
    if verdict.passed:
        return KillResult(item.name, check_id, False, verdict.margin, "survived", verdict.describe(), verdict.metrics,
                          headline)
    exceeded = verdict.margin is not None and verdict.margin > 1.0
    return KillResult(item.name, check_id, True, verdict.margin if exceeded else None,
                      "tolerance" if exceeded else "required fact", verdict.describe(), verdict.metrics, headline)


def _forget(prefix: str) -> None:
    """Drop ablations whose name starts with ``prefix`` (the machinery's own pytester tests use it)."""
    for key in [k for k in _ABLATIONS if k.startswith(prefix)]:
        del _ABLATIONS[key]
