"""A conformance run (``--impl PATH=MODULE:CALLABLE``) from pytest's side: the option parsed and put under test
before any check, the watch that holds every reported check to having called the user's callable, which items such a
run keeps (the path's checks that can call it) and how the rest are summarised. harness.plugins.conformance holds
what runs inside the checks (the implementations under test, the call counts, the declarations)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import pytest

from harness.judging import checks, space
from harness.judging.compare import Verdict
from harness.judging.items import item_check
from harness.paths import path_of
from harness.plugins import conformance
from harness.registry import split_ref

__all__ = ["GUARDED_KEY", "IMPLS_KEY", "NOT_JUDGED_KEY", "OWN_TESTS_KEY", "ImplementationWatch", "apply_impls",
           "conformance_items", "conformance_mark", "deselected_why", "guarded_lines", "header_lines", "item_path",
           "never_ran", "not_judged_lines", "parse_impls", "split_key"]

IMPLS_KEY = pytest.StashKey[dict[str, str]]()  # "path" or "path.subject" -> spec
NOT_JUDGED_KEY = pytest.StashKey[dict[str, str]]()  # conformance mode: deselected check id -> why it cannot judge
GUARDED_KEY = pytest.StashKey[dict[str, str]]()  # conformance mode: check id -> the unsupported input class it feeds
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


def never_ran(config: pytest.Config, judged_paths: set[str], elsewhere: Mapping[str, int] | None = None) -> list[str]:
    """Paths under test whose checks ran while the user's implementation was never called, in this process nor
    (``elsewhere``: calls per path) in the workers that ran the checks of a split run."""
    elsewhere = elsewhere or {}
    return [f"--impl {key}={spec}: no {split_key(key)[0]} check called the implementation under test"
            for key, spec in (config.stash.get(IMPLS_KEY, None) or {}).items()
            if split_key(key)[0] in judged_paths
            and conformance.calls(split_key(key)[0]) + elsewhere.get(split_key(key)[0], 0) == 0]


def split_key(key: str) -> tuple[str, str | None]:
    """``"replay.sd3"`` -> ("replay", "sd3"); ``"replay"`` -> ("replay", None)."""
    path, _, subject = key.partition(".")
    return path, subject or None


def parse_impls(given: list[str] | None) -> dict[str, str]:
    """``["attention=mod:attend", "replay.sd3=fw:sd3_replay", ...]`` -> {"path" or "path.subject": spec}; a malformed
    or repeated one is a usage error naming it."""
    found: dict[str, str] = {}
    for text in given or []:
        key, sep, spec = text.partition("=")
        path, subject = split_key(key)
        if not sep or not path or not spec or (subject is not None and "." in subject):
            raise pytest.UsageError(f"--impl {text!r}: expected PATH=MODULE:CALLABLE or PATH.SUBJECT=MODULE:CALLABLE "
                                    f"with PATH one of {', '.join(conformance.PATHS)} and SUBJECT a replay family, ar "
                                    "model or decode VAE (e.g. --impl attention=my_kernels:attend, --impl "
                                    "replay.sd3=my_trainer.stages:sd3_replay)")
        if key in found:
            what = f"path {path!r}" if subject is None else f"{path} {subject!r}"
            raise pytest.UsageError(f"--impl {text!r}: {what} is already under test ({found[key]})")
        found[key] = spec
    return found


def apply_impls(config: pytest.Config) -> None:
    """Put each ``--impl`` under test now, so a typo or a malformed declaration stops the run before any check."""
    found = parse_impls(config.getoption("impl"))
    for key, spec in found.items():
        path, subject = split_key(key)
        try:
            conformance.use(path, spec, subject)
        except ValueError as err:
            conformance.clear()
            raise pytest.UsageError(f"--impl {key}={spec}: {err}") from None
    config.stash[IMPLS_KEY] = found


def validate_subjects(config: pytest.Config) -> None:
    """Every family, model or VAE an ``--impl`` names (by its key or in its declaration) is one the catalogue drives;
    an unknown one is a usage error listing the known ones (checked once the catalogue is loaded, before any
    check runs)."""
    ids = [c.id for c in checks.all_checks()]
    for key, (spec, declared) in conformance.given().items():
        path, _ = split_key(key)
        axis = space.subject_axis(path)
        if axis is None or declared.subjects is None:
            continue
        known = space.values_named(path, axis.name, ids)
        unknown = [s for s in declared.subjects if s not in known]
        if unknown:
            conformance.clear()
            raise pytest.UsageError(f"--impl {key}={spec}: unknown {axis.name} {', '.join(map(repr, unknown))}; the "
                                    f"{path} catalogue drives {', '.join(known) or 'none'}")


def header_lines(config: pytest.Config) -> list[str]:
    lines = []
    for key, (spec, declared) in conformance.given().items():
        path, subject = split_key(key)
        scope = f"{path} checks" if subject is None else f"{path} checks of {subject}"
        declares = "" if declared.describe().endswith("()") else f", declaring {declared.describe()}"
        lines.append(f"conformance mode: {scope} judge {spec} ({conformance.SIGNATURES[path]}{declares}); other "
                     "paths deselected")
    return lines


def conformance_mark(check: checks.Check) -> str:
    """Whether ``pytest -m cpu --impl PATH=...`` judges the user's implementation with this check, and if not, why."""
    if check.path not in conformance.PATHS:
        return "impl=none (no --impl path)"
    if check.tier != "cpu":
        return "impl=no (gpu tier; a conformance run is -m cpu)"
    found = conformance.judgement(check.id)
    if found.mode in (conformance.NOT_JUDGED_MODE, conformance.OUTSIDE):
        return f"impl=not judged ({found.reason})"
    if found.mode == conformance.GUARDED:
        return f"impl=guard contract ({found.reason})"
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


def _paths_under_test(config: pytest.Config) -> set[str]:
    return {split_key(key)[0] for key in config.stash.get(IMPLS_KEY, None) or {}}


def deselected_why(item: pytest.Item) -> str:
    check_id, _ = item_check(item)
    under_test = _paths_under_test(item.config)
    if under_test and path_of(str(check_id)) not in under_test:
        return f"conformance mode runs only the {', '.join(sorted(under_test))} checks"
    reason = item.config.stash.get(NOT_JUDGED_KEY, {}).get(str(check_id))
    if under_test and reason:
        return f"cannot call the implementation under test: {reason}"
    return "by this run's -m/-k/--deselect"


def conformance_items(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Conformance mode: keep only the checks of the paths under test, deselect those that cannot call an
    implementation under test or lie outside what the implementations declare (kept, with their reasons, for the
    summary) and the paths' other tests (property and fault tests of the suite's own implementation, counted for
    the summary), note the checks judged under the guard contract, and skip the suite's own ablations."""
    impls = config.stash.get(IMPLS_KEY, None)
    if not impls:
        return
    validate_subjects(config)
    under_test = _paths_under_test(config)
    kept, dropped = [], []
    not_judged: dict[str, str] = {}
    guarded: dict[str, str] = {}
    own_tests: dict[str, int] = {}
    for item in items:
        path = item_path(item)
        check_id, ablated = item_check(item)
        if path in under_test and check_id is None:
            own_tests[path] = own_tests.get(path, 0) + 1
        found = conformance.judgement(str(check_id)) if path in under_test and check_id is not None else None
        if found is not None and found.mode != conformance.NOT_JUDGED_MODE and checks.exists(str(check_id)) \
                and checks.get(str(check_id)).tier != "cpu":
            found = None  # a gpu-tier item: -m cpu deselects it (a conformance run is the cpu tier)
        excluded = found is not None and found.mode in (conformance.NOT_JUDGED_MODE, conformance.OUTSIDE)
        if path not in under_test or check_id is None or (excluded and not ablated):
            dropped.append(item)
            if found is not None and excluded:
                not_judged[str(check_id)] = found.reason
            continue
        kept.append(item)
        if found is not None and found.mode == conformance.GUARDED and not ablated:
            guarded[str(check_id)] = found.reason
        if ablated:
            spec = conformance.given().get(found.key or path, (impls.get(path, ""),))[0] if found else ""
            module = split_ref(spec)[0] if spec else "MODULE"
            item.add_marker(pytest.mark.skip(reason=f"the suite's ablations patch the suite's seams, not {spec}; "
                                                    f"measure teeth with scripts/mutation-score --module {module}"))
    config.stash[NOT_JUDGED_KEY] = not_judged
    config.stash[GUARDED_KEY] = guarded
    config.stash[OWN_TESTS_KEY] = own_tests
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


SHOWN_IDS = 8  # a terminal line names this many checks of one reason, then counts the rest


def _ids(ids: list[str], limit: int | None) -> str:
    if limit is None or len(ids) <= limit:
        return ", ".join(ids)
    return f"{', '.join(ids[:limit])} and {len(ids) - limit} more"


def _by_reason(reasons: dict[str, str]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for check_id, reason in sorted(reasons.items()):
        grouped.setdefault(reason, []).append(check_id)
    return grouped


def not_judged_lines(not_judged: dict[str, str], own_tests: dict[str, int] | None = None,
                     limit: int | None = SHOWN_IDS) -> list[str]:
    """The summary of what a conformance run deselected: the checks that cannot call the implementation under
    test, or lie outside what the implementations declare, one line per reason naming them; and per path, how many
    of its tests exercise the suite's own code."""
    lines = [f"not judged: {count} {path} tests of the suite's own implementation (property, fault and unit "
             "tests beside the catalogue, deselected: only the checks judge yours)"
             for path, count in sorted((own_tests or {}).items())]
    if not not_judged:
        return lines
    outside = sum(reason.startswith("outside what") for reason in not_judged.values())
    lines.append(f"not judged: {len(not_judged)} checks cannot call the implementation under test (deselected, "
                 f"neither passed nor failed)" + (f", {outside} of them outside what the implementations declare"
                                                   if outside else "") + ":")
    lines += [f"  {_ids(ids, limit)}: {reason}" for reason, ids in _by_reason(not_judged).items()]
    return lines


def guarded_lines(guarded: dict[str, str], limit: int | None = SHOWN_IDS) -> list[str]:
    """The checks judged under the guard contract (their input class is declared unsupported), one line per reason."""
    if not guarded:
        return []
    lines = [f"guard contract: {len(guarded)} checks feed an input class the implementation declares unsupported; "
             "it must refuse it or take the stock path, never answer otherwise:"]
    lines += [f"  {_ids(ids, limit)}: {reason}" for reason, ids in _by_reason(guarded).items()]
    return lines
