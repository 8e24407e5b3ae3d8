"""A conformance run (``--impl PATH=MODULE:CALLABLE``) from pytest's side: the option parsed and put under test
before any check, the watch that holds every reported check to having called the user's callable, which items such a
run keeps (the path's checks that can call it) and how the rest are summarised. harness.plugins.conformance holds
what runs inside the checks (the implementations under test, the call counts, the declarations)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.judging import checks
from harness.judging.compare import Verdict
from harness.judging.items import item_check
from harness.paths import path_of
from harness.plugins import conformance
from harness.registry import split_ref

__all__ = ["IMPLS_KEY", "NOT_JUDGED_KEY", "OWN_TESTS_KEY", "ImplementationWatch", "apply_impls", "conformance_items",
           "conformance_mark", "deselected_why", "header_lines", "item_path", "never_ran", "not_judged_lines",
           "parse_impls"]

IMPLS_KEY = pytest.StashKey[dict[str, str]]()
NOT_JUDGED_KEY = pytest.StashKey[dict[str, str]]()  # conformance mode: deselected check id -> why it cannot judge
OWN_TESTS_KEY = pytest.StashKey[dict[str, int]]()  # conformance mode: path -> its deselected non-check tests


class ImplementationWatch:
    """How often one check called the implementation under test for its path (conformance mode only).

    The calls are counted by ``conformance.resolve``'s wrapper, in this process and inside every rank of a
    world (each task brings its rank's count back), so a check whose work runs in ranks is seen too.
    """

    def __init__(self, path: str):
        self.path = path
        self.spec = conformance.active(path)
        self.calls_before = conformance.calls(path)

    @property
    def calls(self) -> int:
        return conformance.calls(self.path) - self.calls_before

    def require_ran(self, verdict: Verdict) -> Verdict:
        """Under ``--impl`` a check judges the user's implementation only if it called it: no silent fallback.

        A check that cannot call it is declared with ``conformance.not_judged`` and never reaches here (it
        is deselected); any other check that did not call it fails, whatever its numbers say.
        """
        if self.spec is None:
            return verdict
        calls = self.calls
        return verdict.require(calls > 0, f"the implementation under test ({self.spec}) ran in this check",
                               impl_calls=calls)


def never_ran(config: pytest.Config, judged_paths: set[str]) -> list[str]:
    """Paths under test whose checks ran while the user's implementation was never called in this process."""
    return [f"--impl {path}={spec}: no {path} check called the implementation under test"
            for path, spec in (config.stash.get(IMPLS_KEY, None) or {}).items()
            if path in judged_paths and conformance.calls(path) == 0]


def parse_impls(given: list[str] | None) -> dict[str, str]:
    """``["attention=mod:attend", ...]`` -> {path: spec}; a malformed or unusable spec is a usage error naming it."""
    found: dict[str, str] = {}
    for text in given or []:
        path, sep, spec = text.partition("=")
        if not sep or not path or not spec:
            raise pytest.UsageError(f"--impl {text!r}: expected PATH=MODULE:CALLABLE with PATH one of "
                                    f"{', '.join(conformance.PATHS)} (e.g. --impl attention=my_kernels:attend)")
        if path in found:
            raise pytest.UsageError(f"--impl {text!r}: path {path!r} is already under test ({found[path]})")
        found[path] = spec
    return found


def apply_impls(config: pytest.Config) -> None:
    """Put each ``--impl`` under test now, so a typo stops the run before any check."""
    found = parse_impls(config.getoption("impl"))
    for path, spec in found.items():
        try:
            conformance.use(path, spec)
        except ValueError as err:
            conformance.clear()
            raise pytest.UsageError(f"--impl {path}={spec}: {err}") from None
    config.stash[IMPLS_KEY] = found


def header_lines(config: pytest.Config) -> list[str]:
    return [f"conformance mode: {path} checks judge {spec} ({conformance.SIGNATURES[path]}); other paths deselected"
            for path, spec in (config.stash.get(IMPLS_KEY, None) or {}).items()]


def conformance_mark(check: checks.Check) -> str:
    """Whether ``pytest -m cpu --impl PATH=...`` judges the user's implementation with this check, and if not, why."""
    if check.path not in conformance.PATHS:
        return "impl=none (no --impl path)"
    if check.tier != "cpu":
        return "impl=no (gpu tier; a conformance run is -m cpu)"
    reason = conformance.judged_by(check.id)
    if reason is not None:
        return f"impl=not judged ({reason})"
    scope = conformance.layout_scope(check.id)  # a check of one layout judges the implementations declaring it
    if scope is None:
        return "impl=judged"
    attribute = conformance.LAYOUTS[scope[0]][0]
    return f"impl=judged ({attribute} = {scope[1]!r} implementations)"


_PATH_FILE = re.compile(r"^test_(" + "|".join(conformance.PATHS) + r")[_.]")


def item_path(item: pytest.Item) -> str | None:
    """The path an item tests: its check id's, else its folder's (tests/<path>/) or its module's name
    (test_<path>_*.py); None for machinery."""
    check_id, _ = item_check(item)
    if check_id is not None:
        return path_of(str(check_id))
    file = Path(str(item.path))
    if file.parent.name in conformance.PATHS:
        return file.parent.name
    found = _PATH_FILE.match(file.name)
    return found.group(1) if found else None


def deselected_why(item: pytest.Item) -> str:
    check_id, _ = item_check(item)
    under_test = item.config.stash.get(IMPLS_KEY, None) or {}
    if under_test and path_of(str(check_id)) not in under_test:
        return f"conformance mode runs only the {', '.join(sorted(under_test))} checks"
    reason = item.config.stash.get(NOT_JUDGED_KEY, {}).get(str(check_id))
    if under_test and reason:
        return f"cannot call the implementation under test: {reason}"
    return "by this run's -m/-k/--deselect"


def conformance_items(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Conformance mode: keep only the checks of the paths under test, deselect those that cannot call the user's
    implementation (kept, with their reasons, for the summary) and the paths' other tests (property and fault
    tests of the suite's own implementation, counted for the summary), and skip the suite's own ablations."""
    under_test = config.stash.get(IMPLS_KEY, None)
    if not under_test:
        return
    kept, dropped = [], []
    not_judged: dict[str, str] = {}
    own_tests: dict[str, int] = {}
    for item in items:
        path = item_path(item)
        check_id, ablated = item_check(item)
        if path in under_test and check_id is None:
            own_tests[path] = own_tests.get(path, 0) + 1
        reason = conformance.judged_by(str(check_id)) if path in under_test and check_id is not None else None
        if path not in under_test or check_id is None or (reason is not None and not ablated):
            dropped.append(item)
            if reason is not None:
                not_judged[str(check_id)] = reason
            continue
        kept.append(item)
        if ablated:
            spec = under_test[path]
            module = split_ref(spec)[0]
            item.add_marker(pytest.mark.skip(reason=f"the suite's ablations patch the suite's seams, not {spec}; "
                                                    f"measure teeth with scripts/mutation-score --module {module}"))
    config.stash[NOT_JUDGED_KEY] = not_judged
    config.stash[OWN_TESTS_KEY] = own_tests
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def not_judged_lines(not_judged: dict[str, str], own_tests: dict[str, int] | None = None) -> list[str]:
    """The summary of what a conformance run deselected: the checks that cannot call the implementation under
    test, one line per reason naming them; and per path, how many of its tests exercise the suite's own code."""
    lines = [f"not judged: {count} {path} tests of the suite's own implementation (property, fault and unit "
             "tests beside the catalogue, deselected: only the checks judge yours)"
             for path, count in sorted((own_tests or {}).items())]
    if not not_judged:
        return lines
    by_reason: dict[str, list[str]] = {}
    for check_id, reason in sorted(not_judged.items()):
        by_reason.setdefault(reason, []).append(check_id)
    lines.append(f"not judged: {len(not_judged)} checks cannot call the implementation under test (deselected, "
                 "not passed):")
    lines += [f"  {', '.join(ids)}: {reason}" for reason, ids in by_reason.items()]
    return lines
