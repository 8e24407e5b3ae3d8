"""The implementation under test per path: the suite's own fast function, or a user's (``--impl``).

``--impl PATH=MODULE:CALLABLE`` points a path's catalogue at an implementation that lives in a team's
own framework, with the path's documented signature. Checks fetch the fast function through
``resolve(path, default)``; the callable that comes back is wrapped so every call is counted (inside
a world's ranks too: the counts travel back with each task), and a check that never called it under
``--impl`` fails, so a silent fallback to anything else cannot pass. Specs are plain strings so they
travel into distributed ranks, forked or spawned, and are imported there.

A check that cannot call a user's implementation at all (a stock-only case, a check of the suite's own
clip plan or mask builder, an option only the suite's implementation has) is declared here with
``not_judged(pattern, reason)`` next to its registration: under ``--impl`` it is deselected and listed
with its reason as "not judged", never reported as a pass.

A path whose implementations come in layouts (``LAYOUTS``: ar batches are right- or left-padded) reads the
layout off the callable (``padding_side = "left"``; without the attribute, the path's default), and each of its
catalogues declares the layout it judges with ``judges_layout(pattern, path, layout)``: under ``--impl`` the
checks of the other layout are not judged, with that reason.
"""

from __future__ import annotations

import ast
import contextlib
import fnmatch
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from harness.paths import PATHS
from harness.process import carried
from harness.registry import Registry, load_ref, split_ref

__all__ = ["LAYOUTS", "PATHS", "SIGNATURES", "active", "add_calls", "applied", "call_counts", "calls",
           "check_signature", "clear", "contract_call", "declared_layout", "judged_by", "judges_layout", "layout_scope",
           "load_callable", "not_judged", "resolve", "specs", "use"]

SIGNATURES = {
    "replay": "replay_batched(adapter, conditions, segment, strategy, target, guidance=None, config=None)",
    "ar": "fast_rollout(backend, batch, max_new_tokens, eos)",
    "decode": "sharded_decode(vae, z, group, *, transport='all_gather', dst=0)",
    "attention": "kernel(query, key, value, layout, *, scale=None)",
}

_SPECS: dict[str, str] = {}
_CALLS: dict[str, int] = {}
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
    """The layout ``fn`` declares for ``path`` (its attribute, else the path's default); None for a path without
    layouts. A value that is not one of the path's layouts is a ValueError naming the attribute."""
    if path not in LAYOUTS:
        return None
    attribute, default, layouts = LAYOUTS[path]
    value = getattr(fn, attribute, default)
    if value not in layouts:
        raise ValueError(f"{attribute} = {value!r} on {getattr(fn, '__qualname__', fn)!r}: a {path} implementation "
                         f"declares one of {', '.join(map(repr, layouts))} (default {default!r})")
    return value


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


def judged_by(check_id: str) -> str | None:
    """None when a conformance run judges ``check_id`` with the implementation under test, else the reason
    it cannot: its own declaration, else the most specific (longest) declared pattern that matches it; else, when
    the check judges one layout and the implementation under test declares another, that."""
    reason = _most_specific(check_id, dict(NOT_JUDGED.items()))
    if reason is not None:
        return reason
    scope = layout_scope(check_id)
    spec = _SPECS.get(scope[0]) if scope is not None else None
    if scope is None or spec is None:
        return None
    path, layout = scope
    declared = declared_layout(path, load_callable(spec))
    if declared == layout:
        return None
    attribute = LAYOUTS[path][0]
    return (f"judges {path} implementations declaring {attribute} = {layout!r}; {spec} declares {attribute} = "
            f"{declared!r}")


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


def use(path: str, spec: str) -> None:
    """Put ``spec`` under test for ``path`` (checked now, so a typo or a callable of another signature stops the
    run before any check)."""
    if path not in PATHS:
        raise ValueError(f"--impl {path}={spec}: unknown path {path!r}; expected one of {', '.join(PATHS)}")
    fn = load_callable(spec)
    check_signature(path, spec, fn)
    declared_layout(path, fn)
    _SPECS[path] = spec


def clear() -> None:
    _SPECS.clear()
    _CALLS.clear()


def active(path: str) -> str | None:
    """The spec under test for ``path``, or None when the suite's own implementation is judged."""
    return _SPECS.get(path)


def specs() -> dict[str, str]:
    return dict(_SPECS)


def calls(path: str) -> int:
    """How many times the implementation under test for ``path`` was called in this process."""
    return _CALLS.get(path, 0)


def call_counts() -> dict[str, int]:
    return dict(_CALLS)


def add_calls(made: Mapping[str, int]) -> None:
    """Count calls made elsewhere (inside a world's rank) as made here."""
    for path, count in made.items():
        _CALLS[path] = _CALLS.get(path, 0) + count


def resolve(path: str, default: Callable[..., Any]) -> Callable[..., Any]:
    """The fast function a check must call: the user's (wrapped to count its calls) or ``default``."""
    spec = _SPECS.get(path)
    if spec is None:
        return default
    user = load_callable(spec)

    @functools.wraps(user)
    def counted(*args: Any, **kwargs: Any) -> Any:
        _CALLS[path] = _CALLS.get(path, 0) + 1
        return user(*args, **kwargs)

    return counted


@contextlib.contextmanager
def applied(given: Mapping[str, str]) -> Iterator[None]:
    """Install the parent's specs inside a rank for one task (a spawned rank starts with none)."""
    saved = dict(_SPECS)
    try:
        for path, spec in given.items():
            use(path, spec)
        yield
    finally:
        _SPECS.clear()
        _SPECS.update(saved)


def _calls_since(before: Mapping[str, int]) -> dict[str, int]:
    """Calls made in this process since ``before`` (a rank's tally for one task)."""
    return {p: n - before.get(p, 0) for p, n in _CALLS.items() if n > before.get(p, 0)}


# specs travel into every rank of a world with each task; the calls made there come back with its answer
carried.CARRIED.register("implementations", carried.Carried(
    "implementations", capture=specs, enter=applied, reset=clear, mark=call_counts, tally=_calls_since,
    absorb=add_calls), origin=__name__)
