"""The implementations under test per path: the suite's own fast function, or a user's (``--impl``).

``--impl PATH=MODULE:CALLABLE`` points a path's catalogue at an implementation that lives in a team's own
framework, with the path's documented signature; ``--impl PATH.SUBJECT=MODULE:CALLABLE`` gives one for a single
replay family, ar model or decode VAE (a framework's per-model stages), beside or instead of a path-wide one. Each
callable may carry a typed declaration of what it drives and supports (``harness.plugins.declarations``).

Every check has a point in its path's input space (``harness.judging.space``). Before a check runs, ``select``
picks the implementation that drives its subject; ``judgement`` says, from the point and the declarations, whether
the check judges it as usual, judges it under the guard contract (the point feeds an input class its declaration
leaves out: it must refuse or take the stock path), or cannot judge it at all (outside every declaration, a
stock-only case, another padding layout). Checks fetch the fast function through ``resolve(path, default)``; the
callable that comes back is wrapped so every call is counted and its outcome kept (answered, returned None, raised),
inside a world's ranks too (the counts travel back with each task), and a check that never called it under
``--impl`` fails, so a silent fallback to anything else cannot pass. Specs are plain strings so they travel into
distributed ranks, forked or spawned, and are imported there.

A check that cannot call a user's implementation at all (a stock-only case, a check of the suite's own clip plan or
mask builder, an option only the suite's implementation has) is declared here with ``not_judged(pattern, reason)``
next to its registration. A path whose implementations come in layouts (``LAYOUTS``: ar batches are right- or
left-padded) reads the layout off the callable (its declaration's ``padding_side``, or a ``padding_side``
attribute), and each of its catalogues declares the layout it judges with ``judges_layout(pattern, path, layout)``.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import fnmatch
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from harness.judging import space
from harness.judging.compare import UNSTAMPED, Verdict
from harness.paths import PATHS, path_of
from harness.plugins import declarations
from harness.plugins.declarations import Declaration
from harness.process import carried
from harness.registry import Registry, load_ref, split_ref

__all__ = ["GUARDED", "JUDGED", "LAYOUTS", "NOT_JUDGED", "OUTSIDE", "PATHS", "SIGNATURES", "DeclarationBreach",
           "Judgement", "Outcomes", "active", "add_calls", "applied", "call_counts", "calls", "check_signature",
           "clear", "contract_call", "declaration", "declared_layout", "given", "guard_verdict", "judged_by",
           "judgement", "judges_layout", "layout_scope", "load_callable", "not_judged", "outcomes", "reset_outcomes",
           "resolve", "select", "specs", "use"]

SIGNATURES = {
    "replay": "replay_batched(adapter, conditions, segment, strategy, target, guidance=None, config=None)",
    "ar": "fast_rollout(backend, batch, max_new_tokens, eos)",
    "decode": "sharded_decode(vae, z, group, *, transport='all_gather', dst=0)",
    "attention": "kernel(query, key, value, layout, *, scale=None)",
}


@dataclass(frozen=True)
class _Given:
    """One implementation under test: for a whole path (``subject`` None) or for one family, model or VAE."""

    path: str
    subject: str | None
    spec: str
    declared: Declaration

    @property
    def key(self) -> str:
        return self.path if self.subject is None else f"{self.path}.{self.subject}"


_GIVEN: dict[str, _Given] = {}  # "path" or "path.subject" -> what is under test
_ACTIVE: dict[str, str] = {}  # path -> the key of the implementation the running check judges
_GUARDING: dict[str, str] = {}  # path -> why the running check judges it under the guard contract
_CALLS: dict[str, int] = {}
_OUTCOMES: dict[str, dict[str, Any]] = {}  # path -> {"answered", "none", "refused": counts, "refusal": first text}
# check id or fnmatch pattern -> why no implementation under test can run there
NOT_JUDGED: Registry[str] = Registry("not-judged declaration", list_known=False)


def not_judged(pattern: str, reason: str) -> None:
    """Declare that the checks matching ``pattern`` (an id or an fnmatch pattern) never call the implementation
    under test, and why: under ``--impl`` they are deselected and listed as not judged."""
    if not reason.strip():
        raise ValueError(f"not_judged({pattern!r}): say why no implementation under test can run there")
    if pattern in NOT_JUDGED:
        if NOT_JUDGED.get(pattern) != reason:
            raise ValueError(f"not_judged({pattern!r}) declared twice with different reasons: "
                             f"{NOT_JUDGED.get(pattern)!r} and {reason!r}")
        return
    NOT_JUDGED.register(pattern, reason)


# path -> (the attribute a callable declares its layout by, the layout without it, every layout of the path)
LAYOUTS: dict[str, tuple[str, str, tuple[str, ...]]] = {"ar": ("padding_side", "right", ("right", "left"))}
# check id or fnmatch pattern -> (path, the layout its checks judge)
LAYOUT_CHECKS: Registry[tuple[str, str]] = Registry("layout declaration", list_known=False)


def declared_layout(path: str, fn: Callable[..., Any]) -> str | None:
    """The layout ``fn`` declares for ``path`` (its declaration's, else its attribute, else the path's default);
    None for a path without layouts. A value that is not one of the path's layouts, or an attribute and a
    declaration that disagree, is a ValueError naming the attribute."""
    if path not in LAYOUTS:
        return None
    attribute, default, layouts = LAYOUTS[path]
    value = getattr(fn, attribute, default)
    if value not in layouts:
        raise ValueError(f"{attribute} = {value!r} on {getattr(fn, '__qualname__', fn)!r}: a {path} implementation "
                         f"declares one of {', '.join(map(repr, layouts))} (default {default!r})")
    declared = getattr(getattr(fn, "declares", None), attribute, None)
    if declared is not None and hasattr(fn, attribute) and declared != value:
        raise ValueError(f"{getattr(fn, '__qualname__', fn)!r} declares {attribute} = {declared!r} but its "
                         f"{attribute} attribute says {value!r}: keep one")
    return declared if declared is not None else value


def judges_layout(pattern: str, path: str, layout: str) -> None:
    """Declare that the checks matching ``pattern`` judge only the implementations of ``path`` that declare
    ``layout``; the most specific (longest) matching pattern decides."""
    if path not in LAYOUTS or layout not in LAYOUTS[path][2]:
        raise ValueError(f"judges_layout({pattern!r}): {path!r} has no layout {layout!r}")
    if pattern in LAYOUT_CHECKS:
        if LAYOUT_CHECKS.get(pattern) != (path, layout):
            raise ValueError(f"judges_layout({pattern!r}) declared twice: {LAYOUT_CHECKS.get(pattern)} and "
                             f"{(path, layout)}")
        return
    LAYOUT_CHECKS.register(pattern, (path, layout))


def _most_specific(check_id: str, declared: dict[str, Any]) -> Any:
    if check_id in declared:
        return declared[check_id]
    matching = [pattern for pattern in declared if fnmatch.fnmatchcase(check_id, pattern)]
    return declared[max(matching, key=len)] if matching else None


def layout_scope(check_id: str) -> tuple[str, str] | None:
    """(path, layout) of the implementations ``check_id`` judges, when its catalogue declared one."""
    return _most_specific(check_id, dict(LAYOUT_CHECKS.items()))


# ------------------------------------------------------------------------------ which implementation judges what

JUDGED, GUARDED, OUTSIDE, NOT_JUDGED_MODE = "judged", "guarded", "outside", "not judged"


@dataclass(frozen=True)
class Judgement:
    """How a conformance run treats one check: ``mode`` is judged (as usual), guarded (under the guard contract:
    refuse or take the stock path), outside (no implementation under test declares what it drives) or not judged
    (it cannot call an implementation under test at all); ``key`` the implementation that runs it."""

    mode: str
    key: str | None = None
    reason: str = ""


def _implementation_for(path: str, point: Mapping[str, str]) -> tuple[_Given | None, str]:
    """The implementation that drives ``point``'s subject (one given for it, else the path-wide one, if its
    declaration drives it), or (None, why none does)."""
    axis = space.subject_axis(path)
    subject = point.get(axis.name) if axis is not None else None
    if subject is not None and f"{path}.{subject}" in _GIVEN:
        return _GIVEN[f"{path}.{subject}"], ""
    whole = _GIVEN.get(path)
    if whole is not None:
        outside = whole.declared.outside(point)
        return (None, f"outside what the implementation declares: {outside}") if outside else (whole, "")
    drives = ", ".join(g.subject for g in _GIVEN.values() if g.path == path and g.subject is not None)
    name = axis.name if axis is not None else "subject"
    if subject is None:
        return None, (f"outside what the implementations declare: the check drives no single {name}, and the {path} "
                      f"implementations under test are given per {name} ({drives})")
    return None, f"outside what the implementations declare: it drives {name} {subject!r}; given for {drives}"


def judgement(check_id: str) -> Judgement:
    """How a conformance run treats ``check_id`` (``JUDGED`` when no implementation of its path is under test)."""
    path = path_of(check_id)
    reason = _most_specific(check_id, dict(NOT_JUDGED.items()))
    if reason is not None:
        return Judgement(NOT_JUDGED_MODE, reason=reason)
    if not any(g.path == path for g in _GIVEN.values()):
        return Judgement(JUDGED)
    point = space.point(check_id)
    chosen, why = _implementation_for(path, point)
    if chosen is None:
        return Judgement(OUTSIDE, reason=why)
    scope = layout_scope(check_id)
    if scope is not None:
        layout = declared_layout(path, load_callable(chosen.spec))
        if layout != scope[1]:
            attribute = LAYOUTS[path][0]
            return Judgement(NOT_JUDGED_MODE, chosen.key, f"judges {path} implementations declaring {attribute} = "
                                                          f"{scope[1]!r}; {chosen.spec} declares {attribute} = "
                                                          f"{layout!r}")
    unsupported = chosen.declared.unsupported(point)
    if unsupported:
        return Judgement(GUARDED, chosen.key, f"declared unsupported: {'; '.join(unsupported)}")
    return Judgement(JUDGED, chosen.key)


def judged_by(check_id: str) -> str | None:
    """None when a conformance run judges ``check_id`` with an implementation under test (as usual, or under the
    guard contract), else the reason it cannot: its own not-judged declaration (the most specific matching
    pattern), another padding layout, or a subject no implementation under test declares."""
    found = judgement(check_id)
    return found.reason if found.mode in (NOT_JUDGED_MODE, OUTSIDE) else None


def select(check_id: str) -> Judgement:
    """Make the implementation that judges ``check_id`` the one ``resolve`` hands its path's checks, and note
    whether it runs under the guard contract; called before each check (the state travels into ranks)."""
    found = judgement(check_id)
    path = path_of(check_id)
    _ACTIVE.pop(path, None)
    _GUARDING.pop(path, None)
    if found.key is not None and found.mode in (JUDGED, GUARDED):
        _ACTIVE[path] = found.key
        if found.mode == GUARDED:
            _GUARDING[path] = found.reason
    return found


# ------------------------------------------------------------------------------------------ putting under test


def load_callable(spec: str) -> Callable[..., Any]:
    """``"package.module:callable"`` -> the callable; a bad spec says what is wrong with it."""
    target = load_ref(spec, "implementation", "callable")
    if not callable(target):
        raise ValueError(f"implementation {spec!r}: {split_ref(spec)[1]!r} is not callable")
    return target


# keyword arguments of the contract that every call passes (the others only when they differ from the default:
# decode's transport and dst go to the checks of gather-to-one, where an implementation without them fails)
ALWAYS_PASSED = {"attention": ("scale",)}


def contract_call(path: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The call every check makes on ``path``'s implementation, read from SIGNATURES (parsed, never run): the
    arguments it passes by position, then the keywords every call passes (ALWAYS_PASSED)."""
    tree = ast.parse(f"def {SIGNATURES[path]}: pass")
    function = tree.body[0]
    assert isinstance(function, ast.FunctionDef)
    keywords = tuple(a.arg for a in function.args.kwonlyargs if a.arg in ALWAYS_PASSED.get(path, ()))
    return tuple(a.arg for a in function.args.args), keywords


def check_signature(path: str, spec: str, fn: Callable[..., Any]) -> None:
    """``fn`` can take the call the catalogue makes on ``path``, or a ValueError naming the contract and the
    mismatch: a wrong callable stops the run at configure time, not as a TypeError inside the first check.

    A callable whose signature Python cannot read (a C builtin such as ``max``, an extension function) is refused
    too: every contract passes the suite's own objects (an adapter, a backend, a process group, a layout), which
    no such function knows, so it is never a right implementation as it stands, and a Python wrapper with the
    contract's signature costs one line.
    """
    contract = SIGNATURES[path]
    positional, keywords = contract_call(path)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        raise ValueError(f"implementation {spec!r}: its signature cannot be read (a builtin or extension "
                         f"function?), so it cannot be checked against the {path} contract {contract}; wrap it in a "
                         "Python function with that signature") from None
    try:
        signature.bind(*positional, **dict.fromkeys(keywords))
    except TypeError as err:
        raise ValueError(f"implementation {spec!r}{signature} cannot take the {path} contract's call {contract}: "
                         f"{err}") from None


def use(path: str, spec: str, subject: str | None = None) -> None:
    """Put ``spec`` under test for ``path`` (or for one of its families, models or VAEs), checked now, so a typo,
    a callable of another signature or a malformed declaration stops the run before any check."""
    if path not in PATHS:
        raise ValueError(f"--impl {path}={spec}: unknown path {path!r}; expected one of {', '.join(PATHS)}")
    if subject is not None and space.subject_axis(path) is None:
        raise ValueError(f"{path} implementations are given path-wide (--impl {path}=...): no family, model or VAE "
                         "selects them")
    fn = load_callable(spec)
    check_signature(path, spec, fn)
    declared_layout(path, fn)
    try:
        declared = declarations.for_subject(path, fn, subject)
    except (TypeError, ValueError) as err:
        raise ValueError(f"implementation {spec!r}: {err}") from None
    given_now = _Given(path, subject, spec, declared)
    _GIVEN[given_now.key] = given_now


def clear() -> None:
    _GIVEN.clear()
    _ACTIVE.clear()
    _GUARDING.clear()
    _CALLS.clear()
    _OUTCOMES.clear()


def given() -> dict[str, tuple[str, Declaration]]:
    """Every implementation under test: ``"path"`` or ``"path.subject"`` -> (spec, its declaration)."""
    return {key: (g.spec, g.declared) for key, g in sorted(_GIVEN.items())}


def active(path: str) -> str | None:
    """The spec the running check of ``path`` judges (the path-wide one outside a check), or None when the suite's
    own implementation runs."""
    key = _ACTIVE.get(path, path)
    found = _GIVEN.get(key)
    return found.spec if found is not None else None


def declaration(path: str) -> Declaration | None:
    """The declaration of the implementation the running check of ``path`` judges; None for the suite's own."""
    key = _ACTIVE.get(path, path)
    found = _GIVEN.get(key)
    return found.declared if found is not None else None


def specs() -> dict[str, str]:
    """``"path"`` or ``"path.subject"`` -> spec, for the report."""
    return {key: g.spec for key, g in sorted(_GIVEN.items())}


def calls(path: str) -> int:
    """How many times an implementation under test for ``path`` was called in this process."""
    return _CALLS.get(path, 0)


def call_counts() -> dict[str, int]:
    return dict(_CALLS)


def add_calls(made: Mapping[str, int]) -> None:
    """Count calls made elsewhere (inside a world's rank) as made here."""
    for path, count in made.items():
        _CALLS[path] = _CALLS.get(path, 0) + count


# ------------------------------------------------------------------------------------ calls and their outcomes


class DeclarationBreach(AssertionError):
    """An implementation raised NotImplementedError on an input inside its own declaration."""


@dataclass(frozen=True)
class Outcomes:
    """What the calls of one check did: answered (returned a value), returned None, or raised (``refusal``: the
    first raise, ``TypeName: message``)."""

    answered: int = 0
    none: int = 0
    refused: int = 0
    refusal: str = ""

    @property
    def calls(self) -> int:
        return self.answered + self.none + self.refused


def outcomes(path: str) -> Outcomes:
    found = _OUTCOMES.get(path, {})
    return Outcomes(found.get("answered", 0), found.get("none", 0), found.get("refused", 0), found.get("refusal", ""))


def _record(path: str, kind: str, error: BaseException | None = None) -> None:
    found = _OUTCOMES.setdefault(path, {})
    found[kind] = found.get(kind, 0) + 1
    if error is not None and not found.get("refusal"):
        found["refusal"] = f"{type(error).__name__}: {next(iter(str(error).splitlines()), '')}"[:300]


def _add_outcomes(made: Mapping[str, Mapping[str, Any]]) -> None:
    for path, counts in made.items():
        found = _OUTCOMES.setdefault(path, {})
        for kind, value in counts.items():
            if kind == "refusal":
                found.setdefault("refusal", value)
            else:
                found[kind] = found.get(kind, 0) + value


def reset_outcomes(path: str) -> None:
    """Forget the outcomes recorded for ``path`` (before a check runs)."""
    _OUTCOMES.pop(path, None)


def resolve(path: str, default: Callable[..., Any]) -> Callable[..., Any]:
    """The fast function a check must call: the implementation under test that judges it (wrapped to count its
    calls and keep their outcomes) or ``default``."""
    key = _ACTIVE.get(path, path)
    chosen = _GIVEN.get(key)
    if chosen is None:
        return default
    user = load_callable(chosen.spec)

    @functools.wraps(user)
    def counted(*args: Any, **kwargs: Any) -> Any:
        _CALLS[path] = _CALLS.get(path, 0) + 1
        try:
            result = user(*args, **kwargs)
        except NotImplementedError as err:
            _record(path, "refused", err)
            if path in _GUARDING:
                raise
            raise DeclarationBreach(f"{chosen.spec} raised NotImplementedError on an input inside its declaration "
                                    f"{chosen.declared.describe()}: {err}") from err
        except Exception as err:
            _record(path, "refused", err)
            raise
        _record(path, "none" if result is None else "answered")
        return result

    return counted


# ------------------------------------------------------------------------------------------- the guard contract

DECLINES = {"replay": "returned None: the caller takes the serial loop"}  # paths where None means "take stock"


def guard_verdict(path: str, reason: str, found: Outcomes, verdict: Verdict | None,
                  error: BaseException | None = None, every_rank_raised: bool = True) -> Verdict:
    """The guard contract for a check whose input class the implementation declares unsupported: every call
    refused it (raised; in a world, on every rank) or took the stock path (``None`` where the path's contract means
    "decline", or an answer the check's numbers accept), never a different answer. ``verdict`` is what the check
    itself found (None when it raised ``error``)."""
    policy = f"guard contract ({reason}): refuse or take the stock path, never a different answer"
    # no call answered, and some raised or the path's contract reads a None as "take the stock path"
    if (found.calls and found.answered == 0 and (found.refused or path in DECLINES)
            and (error is None or every_rank_raised)):
        how = (f"refused: {found.refusal}" if found.refused and not found.none
               else DECLINES.get(path, "returned None") if not found.refused
               else f"refused or declined ({found.refused} raised, {found.none} returned None)")
        return Verdict(UNSTAMPED, True, {"guard": how, "calls": found.calls}, policy, None, headline="guard")
    if error is not None:
        where = "" if every_rank_raised else " (not on every rank: the others were left waiting)"
        return Verdict(UNSTAMPED, False, {"guard": f"raised{where}: {type(error).__name__}: {error}"[:300],
                                          "calls": found.calls}, policy, None, headline="guard",
                       message=f"the implementation under test raised{where} after answering {found.answered} "
                               f"call(s): {type(error).__name__}: {error}"[:400])
    assert verdict is not None
    numbers_pass = verdict.passed or (all(fact in verdict.ran_facts for fact in verdict.violated_facts)
                                      and (verdict.margin is None or verdict.margin <= 1.0))
    if numbers_pass:
        return dataclasses.replace(verdict, passed=True, policy=f"{policy}; {verdict.policy}",
                                   metrics={"guard": "the stock answer", **verdict.metrics})
    return dataclasses.replace(verdict, policy=f"{policy}; {verdict.policy}",
                               metrics={"guard": "a different answer", **verdict.metrics},
                               message=f"returned a different answer on an input class it declares unsupported "
                                       f"({reason}):\n{verdict.message}")


# ----------------------------------------------------------------------------------------- carried into ranks


@dataclass(frozen=True)
class _State:
    """What a task carries into its ranks: every implementation under test and the running check's selection."""

    given: tuple[tuple[str, str, str | None], ...] = ()  # (path, spec, subject)
    active: tuple[tuple[str, str], ...] = ()
    guarding: tuple[tuple[str, str], ...] = ()


def _capture() -> _State:
    return _State(tuple((g.path, g.spec, g.subject) for g in _GIVEN.values()), tuple(_ACTIVE.items()),
                  tuple(_GUARDING.items()))


@contextlib.contextmanager
def _entered(state: _State) -> Iterator[None]:
    saved = [(target, dict(target)) for target in (_GIVEN, _ACTIVE, _GUARDING)]
    try:
        for path, spec, subject in state.given:
            use(path, spec, subject)
        _ACTIVE.update(state.active)
        _GUARDING.update(state.guarding)
        yield
    finally:
        for target, kept in saved:
            target.clear()
            target.update(kept)


@contextlib.contextmanager
def applied(given_specs: Mapping[str, str]) -> Iterator[None]:
    """Install ``{"path" or "path.subject": spec}`` for one task (a spawned rank starts with none)."""
    state = _State(tuple((key.partition(".")[0], spec, key.partition(".")[2] or None)
                         for key, spec in given_specs.items()))
    with _entered(state):
        yield


def _mark() -> tuple[dict[str, int], dict[str, dict[str, Any]]]:
    """Rank side, before a task: the counts to measure from (a refusal's text is the task's own, so an earlier
    task's is dropped)."""
    for found in _OUTCOMES.values():
        found.pop("refusal", None)
    return dict(_CALLS), {path: dict(found) for path, found in _OUTCOMES.items()}


def _since(before: tuple[dict[str, int], dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Calls made in this process since ``before``, and their outcomes (a rank's tally for one task)."""
    calls_before, outcomes_before = before
    made = {p: n - calls_before.get(p, 0) for p, n in _CALLS.items() if n > calls_before.get(p, 0)}
    happened: dict[str, dict[str, Any]] = {}
    for path, found in _OUTCOMES.items():
        old = outcomes_before.get(path, {})
        counts = {k: v - old.get(k, 0) for k, v in found.items() if k != "refusal" and v > old.get(k, 0)}
        if found.get("refusal") and not old.get("refusal"):
            counts["refusal"] = found["refusal"]
        if counts:
            happened[path] = counts
    return {"calls": made, "outcomes": happened}


def _absorb(tally: Mapping[str, Any]) -> None:
    add_calls(tally.get("calls", {}))
    _add_outcomes(tally.get("outcomes", {}))


def _reset() -> None:
    clear()


# what is under test travels into every rank of a world with each task; the calls made there come back with its answer
carried.CARRIED.register("implementations", carried.Carried(
    "implementations", capture=_capture, enter=_entered, reset=_reset, mark=_mark, tally=_since, absorb=_absorb),
    origin=__name__)
