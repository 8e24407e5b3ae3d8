"""Ablations: one known bug re-introduced over one seam, with the checks it must make fail.

A seam is a module-level function (``"harness.replay.tiling:tile_conditions"``). Applying an
ablation swaps that attribute from outside and always restores it, so implementation code carries
no test-only flags. Active ablations travel with distributed tasks (registered as a carried context,
harness.process.carried, that every world re-applies inside each rank), because ranks forked before the patch
would not see it.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from harness.judging import checks
from harness.paths import path_of
from harness.process import carried
from harness.process.dist import WorldTimeout
from harness.registry import Registry, import_ref, load_ref, split_ref

__all__ = ["ABLATIONS", "KILL_MODES", "Ablation", "KillResult", "ablation", "active", "all_ablations", "applied",
           "drop_inherited", "fresh_caches", "get", "run_under", "validate_claims"]

# How an ablation must be caught. "tolerance": the ablated verdict fails with a number over its tolerance
# (margin > 1); "fact": it fails on a violated required fact (a spy) naming ``fact``; "raises": one of the
# declared exception types escapes; "hang": harness.process.dist.WorldTimeout within ``hang_timeout_s``.
KILL_MODES = ("tolerance", "fact", "raises", "hang")


@dataclass(frozen=True)
class Ablation:
    """A named bug (``path.bug``) patched over ``seam`` that must kill every check in ``kills``.

    ``replacement`` is the buggy function; with ``wraps=True`` it is a factory called with the
    original function and returning the buggy one. ``kill_mode`` (one of KILL_MODES) is how every
    claimed check must catch it; ``modes`` holds the claims caught another way (check id -> mode).
    ``facts`` maps a claim to the text its violated required fact must contain (a "fact" kill); ``raises`` the
    exception types of a "raises" kill; ``hang_timeout_s`` bounds distributed tasks for a "hang" kill.
    """

    name: str
    seam: str
    replacement: Callable[..., Any]
    kills: tuple[str, ...]
    why: str
    kill_mode: str = "tolerance"
    modes: dict[str, str] = field(default_factory=dict, compare=False)
    facts: dict[str, str] = field(default_factory=dict, compare=False)
    wraps: bool = False
    raises: tuple[type[BaseException], ...] = ()
    hang_timeout_s: float | None = None
    origin: str = field(default="", compare=False)
    stock: bool = False  # the seam is code the stock path runs: stock results cached before it are recomputed

    @property
    def path(self) -> str:
        return path_of(self.name)

    def mode_for(self, check_id: str) -> str:
        """The kill mode declared for one claimed check."""
        return self.modes.get(check_id, self.kill_mode)

    def resolve(self) -> tuple[Any, str]:
        return resolve_seam(self.seam)

    @contextlib.contextmanager
    def apply(self) -> Iterator[None]:
        owner, attr = self.resolve()
        original = getattr(owner, attr)
        patched = self.replacement(original) if self.wraps else self.replacement
        with fresh_caches() if self.stock else contextlib.nullcontext():
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


# the packages whose module-level caches hold stock results (references, floors, controls, loaded models)
CACHED_RESULT_PACKAGES = ("parity.", "fixtures.", "gpu.", "examples.")


@contextlib.contextmanager
def fresh_caches() -> Iterator[int]:
    """Every module-level ``functools`` cache of the catalogue's packages swapped for an empty one of the same
    function for the block, and the originals (with the results they hold) put back after: a stock result is
    computed again under an ablation of code the stock path runs, and what it computes there never outlives it.
    Yields how many caches were swapped."""
    fresh: dict[int, Any] = {}
    swapped: list[tuple[Any, str, Any]] = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(CACHED_RESULT_PACKAGES):
            continue
        for attr, value in list(vars(module).items()):
            if not (callable(getattr(value, "cache_clear", None)) and hasattr(value, "cache_parameters")
                    and hasattr(value, "__wrapped__")):
                continue
            if id(value) not in fresh:
                maxsize = value.cache_parameters()["maxsize"]
                fresh[id(value)] = functools.lru_cache(maxsize=maxsize)(value.__wrapped__)
            swapped.append((module, attr, value))
            setattr(module, attr, fresh[id(value)])
    try:
        yield len(fresh)
    finally:
        for module, attr, value in swapped:
            setattr(module, attr, value)


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
    """``"pkg.module:function"`` -> (owner object, attribute name); unknown seams raise naming them."""
    owner, leaf = import_ref(seam, "seam", "function")
    if not callable(getattr(owner, leaf, None)):
        raise ValueError(f"seam {seam!r}: {split_ref(seam)[0]} has no callable {split_ref(seam)[1]!r}")
    return owner, leaf


ABLATIONS: Registry[Ablation] = Registry("ablation", list_known=False)
_ACTIVE: list[_Patch] = []
_LOADER = "harness.judging.catalogue:load"  # what a fresh (spawned) rank calls to rebuild the registries


def ablation(name: str, seam: str, replacement: Callable[..., Any], *, kills: Sequence[str], why: str,
             kill_mode: str, modes: Mapping[str, str] | None = None, fact: str | Mapping[str, str] | None = None,
             wraps: bool = False, raises: Sequence[type[BaseException]] = (),
             hang_timeout_s: float | None = None, stock: bool = False) -> Ablation:
    """Register an ablation; its claimed check ids are validated when the catalogue loads (validate_claims).

    Every claim in ``kills`` is caught in ``kill_mode`` unless ``modes`` declares another mode for it
    (every mode is declared, none inferred). ``fact`` is the text the violated spy fact must contain, or
    a mapping check id -> text where the claims violate different facts. ``stock`` declares a seam the stock
    path runs (a model's own layer, a family adapter): cached stock results are recomputed under it.
    """
    if "." not in name or not name.islower():
        raise ValueError(f"ablation name {name!r} must read 'path.bug' in lowercase")
    if not kills:
        raise ValueError(f"ablation {name!r} names no check to kill")
    claims = dict.fromkeys(kills, kill_mode)
    stray = sorted(set(modes or {}) - set(claims))
    if stray:
        raise ValueError(f"ablation {name!r}: modes given for checks it does not claim: {stray}")
    claims.update(modes or {})
    for check_id, mode in {"(kill_mode)": kill_mode, **claims}.items():
        if mode not in KILL_MODES:
            raise ValueError(f"ablation {name!r}: kill mode {mode!r} for {check_id} is not one of {KILL_MODES}")
    used = set(claims.values())
    missing = [c for c, m in claims.items() if m == "fact" and not (
        fact.get(c) if isinstance(fact, Mapping) else fact)]
    if missing:
        raise ValueError(f"ablation {name!r}: a 'fact' kill must name the spy fact it violates (fact=...): {missing}")
    if "raises" in used and not raises:
        raise ValueError(f"ablation {name!r}: a 'raises' kill must declare its exception types (raises=...)")
    if "hang" in used and hang_timeout_s is None:
        raise ValueError(f"ablation {name!r}: a 'hang' kill must bound its wait (hang_timeout_s=...)")
    split_ref(seam, "seam", "function")
    origin = sys._getframe(1).f_globals.get("__name__", "")  # inspect.stack() reads every frame's source
    overrides = {c: m for c, m in claims.items() if m != kill_mode}
    facts = dict(fact) if isinstance(fact, Mapping) else ({c: fact for c in claims} if fact else {})
    item = Ablation(name, seam, replacement, tuple(claims), why, kill_mode, overrides, facts, wraps, tuple(raises),
                    hang_timeout_s, origin, stock)
    return ABLATIONS.register(name, item, origin=origin)


def validate_claims(names: Sequence[str] | None = None) -> None:
    """Every claimed check exists and every seam resolves; called once the whole catalogue is loaded.

    Validation waits for the catalogue because an ablation may claim checks that another module
    registers (a decode ablation claims the gpu tier's decode check).
    """
    problems = []
    for item in ABLATIONS.values() if names is None else [get(n) for n in names]:
        unknown = [c for c in item.kills if not checks.exists(c)]
        if unknown:
            problems.append(f"ablation {item.name!r} claims unknown check ids: {unknown}")
        try:
            resolve_seam(item.seam)
        except ValueError as err:
            problems.append(f"ablation {item.name!r}: {err}")
    if problems:
        raise ValueError("\n".join(problems))


def set_loader(spec: str) -> None:
    """Name the ``module:function`` a rank calls to rebuild the catalogue before re-applying ablations."""
    global _LOADER
    _LOADER = spec


def get(name: str) -> Ablation:
    return ABLATIONS.get(name)


def all_ablations(path: str | None = None) -> list[Ablation]:
    return [a for a in ABLATIONS.values() if path is None or a.path == path]


def active() -> list[tuple[str, str]]:
    """(name, catalogue loader) of every applied ablation, for re-application inside ranks."""
    return [(p.item.name, _LOADER) for p in _ACTIVE]


@contextlib.contextmanager
def applied(refs: Sequence[tuple[str, str]]) -> Iterator[None]:
    """Re-apply ablations by reference (inside a rank process).

    A spawned rank starts with empty registries: it loads the whole catalogue through the loader the
    parent named (never one ablation module alone, whose claims may live in another module).
    """
    with contextlib.ExitStack() as stack:
        for name, loader in refs:
            if name not in ABLATIONS and loader:
                load_ref(loader, "catalogue loader", "function")()
            stack.enter_context(get(name).apply())
        yield


carried.CARRIED.register("ablations", carried.Carried("ablations", capture=active, enter=applied,
                                                     reset=drop_inherited), origin=__name__)


@dataclass(frozen=True)
class KillResult:
    """What one check did under one ablation.

    ``mode`` is how the check failed (one of KILL_MODES, "survived", or "wrong exception <Type>");
    ``killed`` is true only when that is the mode the ablation declared for this check. ``margin`` is the
    ablated verdict's error / tolerance when a tolerance was exceeded. ``metrics`` are the ablated verdict's.
    """

    ablation: str
    check: str
    killed: bool
    margin: float | None
    how: str  # a readable account: "tolerance", "fact: <text>", "raised <Type>", "survived", ...
    detail: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    headline: str = ""  # the ablated verdict's headline metric, e.g. "max_abs=1.9e+04"
    mode: str = ""
    declared: str = ""


def run_under(item: Ablation, check_id: str, ctx: checks.CheckContext) -> KillResult:
    """Run ``check_id`` with ``item`` applied and say whether it was killed in its declared mode."""
    declared = item.mode_for(check_id)
    previous = ctx.task_timeout_s
    if item.hang_timeout_s is not None:
        ctx.task_timeout_s = item.hang_timeout_s
    hang = (WorldTimeout,)
    try:
        with item.apply():
            verdict = checks.run_check(check_id, ctx)
    except Exception as err:  # noqa: BLE001 - every escape is classified against the declaration
        name = type(err).__name__
        if isinstance(err, hang):
            mode = "hang"
        elif item.raises and isinstance(err, item.raises):
            mode = "raises"
        else:
            mode = f"wrong exception {name}"
        killed = mode == declared
        return KillResult(item.name, check_id, killed, None, f"raised {name}", str(err)[:500], mode=mode,
                          declared=declared)
    finally:
        ctx.task_timeout_s = previous
    value = verdict.headline_value
    headline = f"{verdict.headline}={value:.3e}" if isinstance(value, float) else (
        f"{verdict.headline}={value}" if verdict.headline else "")
    if verdict.passed:
        return KillResult(item.name, check_id, False, verdict.margin, "survived", verdict.describe(), verdict.metrics,
                          headline, mode="survived", declared=declared)
    exceeded = verdict.margin is not None and verdict.margin > 1.0
    violated = verdict.violated_facts
    if declared == "tolerance" or (exceeded and declared not in ("fact",)):
        mode = "tolerance" if exceeded else "fact"
    else:
        mode = "fact" if violated else ("tolerance" if exceeded else "failed")
    expected_fact = item.facts.get(check_id)
    if declared == "fact" and mode == "fact" and expected_fact and not any(expected_fact in f for f in violated):
        mode = "other fact"
    how = "tolerance" if mode == "tolerance" else (f"fact: {'; '.join(violated)}" if violated else mode)
    return KillResult(item.name, check_id, mode == declared, verdict.margin if exceeded else None, how,
                      verdict.describe(), verdict.metrics, headline, mode=mode, declared=declared)
