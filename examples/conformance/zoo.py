"""The bug zoo: every implementation in ``examples/conformance/zoo_<path>.py`` judged as a team would judge its
own, by ``pytest -m cpu --impl PATH=zoo_<path>:NAME``, one run each.

Each zoo module holds one right implementation of its path (``CORRECT``, the callable named like the path's
signature), right ones of its other layouts (``MORE_CORRECT``: name -> (flaws, what it is); ar's left-padded
rollout) and realistic buggy ones (``BUGS``: name -> (flaws, what the bug is)). The right ones must pass
with every check of its path either judged (and passed) or declared not judged; every buggy one must fail,
naming the checks it fails; one that never works (``FAILS_EVERYWHERE``) must fail every check it is judged
by. With ``--corpus`` the publicly reported bugs of ``examples/conformance/corpus/<path>.py`` join them: each
must fail, and fail at least the checks its report declares. Implementations that carry the same flaws (a
report re-created exactly as a zoo bug) share one run. Prints the table (implementation -> verdict -> failing
checks) and exits 1 when any implementation does not do what it should. A buggy implementation's verdict is decided
by its first failing check, so by default a zoo bug's run stops there and a reported bug's run judges only the checks
its report declares (each must fail); ``--full`` judges every buggy one over its whole path for the complete table.

    python examples/conformance/zoo.py                        # every path
    python examples/conformance/zoo.py --path decode --markdown reports/zoo-decode.md
    python examples/conformance/zoo.py --path ar --corpus     # the zoo and the reported bugs of one path
    python examples/conformance/zoo.py --only ar:ignores_eos  # one implementation

Run from the repository root, with ``examples/conformance`` importable (``examples/run-examples`` sets it).

Each run is a fresh pytest session in a process forked from this one, so the runs share the start-up a
fresh interpreter would repeat (about a third of a short run): after the first run, this process imports
the third-party modules that run used (torch, transformers, diffusers, ...) and every later run inherits
them. Nothing of the suite itself is imported here before a fork (entry-point plugins register families
that its catalogue modules read at import), so each run's session starts from what a fresh interpreter
would have. ``--fresh`` runs each in a new interpreter instead.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import functools
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PATHS = {"replay": "replay_batched", "ar": "fast_rollout", "decode": "sharded_decode", "attention": "attend"}
CHECK_TEST = "parity/test_parity.py::test_parity_check"  # the catalogue's one test, parametrized by check id
FAILED_ITEM = re.compile(r"^FAILED \S*::test_parity_check\[([^\]]+)\]")


@dataclass(frozen=True)
class Entry:
    path: str
    name: str
    expected: str  # "pass", "fail" (naming its checks) or "fail all" (every judged check)
    bug: str
    module: str = ""  # the module holding the callable; "" = zoo_<path>
    checks: tuple[str, ...] = ()  # checks the run must fail (a corpus report's declared ones)
    flaws: Any = None  # the Flaws value it carries: entries with equal flaws share one run

    @property
    def spec(self) -> str:
        return f"{self.module or f'zoo_{self.path}'}:{self.name}"

    def selection(self, full: bool) -> str:
        """What its run judges: ``"all"`` of its path's checks (a right one, one that fails everywhere, or any
        with ``full``), ``"declared"`` (a reported bug: the checks its report declares, each of which must fail), or
        ``"first failure"`` (a zoo bug: every check, stopping at the first that fails, when the verdict is
        decided)."""
        if full or self.expected != "fail":
            return "all"
        return "declared" if self.checks else "first failure"

    def run_key(self, full: bool = False) -> tuple[Any, ...]:
        """Entries with the same key behave identically, so one conformance run judges them all."""
        selection = self.selection(full)
        return (self.path, self.flaws if self.flaws is not None else self.spec, selection,
                self.checks if selection == "declared" else ())


@dataclass
class Outcome:
    entry: Entry
    exit_code: int
    judged: list[str] = field(default_factory=list)
    failing: list[str] = field(default_factory=list)
    not_judged: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # checks of the path neither judged nor declared not judged
    seconds: float = 0.0
    output: str = ""  # the run's output tail, shown when the outcome is unexpected
    shared_with: str = ""  # the implementation whose run judged this one too
    selection: str = "all"  # what the run judged (``Entry.selection``)

    @property
    def unmet(self) -> list[str]:
        """Checks the entry declares that the run did not fail."""
        return [c for c in self.entry.checks if c not in self.failing]

    @property
    def verdict(self) -> str:
        if self.exit_code == 0 and not self.failing and not self.missing:
            return "PASS"
        if self.exit_code == 1 and self.failing:
            return "FAIL ALL" if self.failing == self.judged and self.selection == "all" else "FAIL"
        return f"ERROR (pytest exit {self.exit_code})"

    @property
    def as_expected(self) -> bool:
        if self.entry.expected == "fail":
            return self.verdict in ("FAIL", "FAIL ALL") and not self.unmet
        return self.verdict == self.entry.expected.upper()


def entries(paths: list[str], corpus: bool = False) -> list[Entry]:
    found = []
    for path in paths:
        module = importlib.import_module(f"zoo_{path}")
        found.append(Entry(path, PATHS[path], "pass", "right (independent of the suite's own)", flaws=module.CORRECT))
        found += [Entry(path, name, "pass", why, flaws=flaws)
                  for name, (flaws, why) in getattr(module, "MORE_CORRECT", {}).items()]
        found += [Entry(path, name, "fail", why, flaws=flaws) for name, (flaws, why) in module.BUGS.items()]
        found += [Entry(path, name, "fail all", why) for name, why in getattr(module, "FAILS_EVERYWHERE", {}).items()]
        if corpus:
            reports = importlib.import_module(f"corpus.{path}").REPORTS
            found += [Entry(path, name, "fail", report.summary, module=f"corpus.{path}", checks=report.checks,
                            flaws=report.flaws) for name, report in reports.items()]
    return found


def catalogue(path: str) -> list[str]:
    """The ids of ``path``'s CPU checks, read in this process."""
    from harness.judging import catalogue as catalogue_mod
    from harness.judging import checks

    catalogue_mod.load()
    return sorted(c.id for c in checks.all_checks("cpu", path=path))


def catalogue_forked(path: str) -> list[str]:
    """``catalogue(path)`` read in a forked child: the suite's catalogue is never imported into the zoo's
    process, which later runs are forked from."""
    with tempfile.TemporaryDirectory() as tmp:
        out, log = Path(tmp) / "catalogue.json", Path(tmp) / "catalogue.log"
        code = fork(functools.partial(_write_catalogue, path, out), log)
        if code != 0:
            raise RuntimeError(f"reading the {path} catalogue failed (exit {code}): "
                               f"{log.read_text(errors='replace')[-3000:]}")
        return json.loads(out.read_text())


def _write_catalogue(path: str, out: Path) -> int:
    out.write_text(json.dumps(catalogue(path)))
    return 0


FIRST_PARTY = ("harness", "parity", "fixtures", "tests", "mutation", "gpu", "conftest", "zoo", "corpus",
               "parity_plugin_example", "__main__", "__mp_main__")


# pytest and its plugins keep state that a session sets up (hypothesis counts its initialisation): each run's
# session imports them itself, as a fresh interpreter would
SESSION_PACKAGES = ("pytest", "_pytest", "pluggy", "hypothesis", "_hypothesis_globals", "_hypothesis_pytestplugin",
                    "pytest_benchmark", "anyio", "xdist", "pytest_randomly", "typeguard")


def third_party(modules: list[str]) -> list[str]:
    """The modules a run imported that are neither the suite's, the examples' nor pytest's: safe to import
    before a fork."""
    def shared(name: str) -> bool:
        top = name.split(".")[0]
        return top not in FIRST_PARTY and top not in SESSION_PACKAGES and not top.startswith(("zoo_", "pytest_"))

    return sorted(filter(shared, modules))


def preload(modules: list[str]) -> int:
    """Import ``modules`` here, so every later forked run inherits them; one that fails to import is skipped
    (the run imports it itself, as a fresh interpreter would)."""
    imported = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in modules:
            try:
                importlib.import_module(name)
                imported += 1
            except Exception:  # noqa: BLE001 - an optional backend a library probes for; the run imports what it needs
                continue
    return imported


CATALOGUE_PACKAGES = ("parity", "mutation", "gpu")  # imported by a run's session only, after its plugins load


def fork(work: Callable[[], int], log: Path) -> int:
    """``work()`` in a child forked from this process, its output to ``log``; its exit code."""
    imported = [name for name in CATALOGUE_PACKAGES if name in sys.modules]
    if imported:  # a run forked now would skip its session's own import order (plugins first, then catalogue)
        raise RuntimeError(f"the suite's catalogue ({', '.join(imported)}) was imported into the zoo's process")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 3
        _own_exit_handlers()
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = work()
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _own_exit_handlers() -> None:
    """At its exit a forked child runs only the exit handlers it registered itself: one it inherited (a
    TemporaryDirectory's finalizer) would remove what this process still uses."""
    atexit._clear()
    weakref.finalize._registered_with_atexit = False  # the child's own finalizers register anew
    for info in list(weakref.finalize._registry.values()):
        info.atexit = False


def _pytest_session(args: list[str], modules: Path | None) -> int:
    """``pytest.main(args)``; with ``modules``, the names of every module it had imported are written there."""
    import pytest

    code = int(pytest.main(args))
    if modules is not None:
        modules.write_text(json.dumps(sorted(sys.modules)))
    return code


@dataclass
class Runner:
    """Runs one pytest session per implementation: forked from this process (sharing the start-up, see the
    module docstring) or, with ``fresh``, in a new interpreter."""

    fresh: bool = False
    preloaded: bool = False

    def run(self, args: list[str], tmp: Path) -> tuple[int, str]:
        if threading.active_count() > 1 and not self.fresh:  # a lock another thread holds at a fork stays held
            print(f"zoo: {threading.active_count() - 1} thread(s) besides the main one: each run now starts a "
                  "fresh interpreter", file=sys.stderr)
            self.fresh = True
        if self.fresh:
            done = subprocess.run([sys.executable, "-m", "pytest", *args], capture_output=True, text=True,
                                  check=False)
            return done.returncode, f"{done.stdout}\n{done.stderr}"
        log, modules = tmp / "pytest.log", tmp / "modules.json"
        code = fork(functools.partial(_pytest_session, args, None if self.preloaded else modules), log)
        if not self.preloaded and modules.exists():
            preload(third_party(json.loads(modules.read_text())))
            self.preloaded = True
        return code, log.read_text(errors="replace") if log.exists() else ""


def judge(entry: Entry, tests: list[str], extra: list[str], runner: Runner, full: bool = False) -> Outcome:
    """One conformance run of ``entry``'s implementation over its path's catalogue (``Entry.selection``)."""
    selection = entry.selection(full)
    if selection == "declared":
        tests = [f"{CHECK_TEST}[{check}]" for check in entry.checks]
    stop = ["--maxfail=1"] if selection == "first failure" else []
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        args = ["-m", "cpu", "-q", "-rf", "-p", "no:cacheprovider", "--impl", f"{entry.path}={entry.spec}",
                f"--parity-report={report}", *stop, *tests, *extra]
        began = time.perf_counter()
        code, output = runner.run(args, Path(tmp))
        seconds = time.perf_counter() - began
        data = json.loads(report.read_text()) if report.exists() else {"checks": []}
    failing = {c["id"] for c in data["checks"] if not c["passed"]}
    failing |= {m.group(1) for line in output.splitlines() if (m := FAILED_ITEM.match(line))}
    judged = sorted({c["id"] for c in data["checks"]} | failing)
    not_judged = sorted(data.get("not_judged", {}))
    return Outcome(entry, code, judged, sorted(failing), not_judged, seconds=seconds, output=output[-9000:],
                   selection=selection)


def table(outcomes: list[Outcome]) -> str:
    lines = ["| implementation | expected | verdict | judged | failing checks |", "|---|---|---|---|---|"]
    for o in outcomes:
        shown = ", ".join(f"`{c}`" for c in o.failing[:8]) + (f" (+{len(o.failing) - 8} more)"
                                                              if len(o.failing) > 8 else "")
        failing = f"{len(o.failing)}: {shown}" if o.failing else "none"
        if o.missing:
            failing += f"; not run: {', '.join(o.missing[:5])}"
        if o.unmet:
            failing += f"; declared but not failed: {', '.join(o.unmet)}"
        if o.selection != "all":
            failing += f" ({o.selection} only)" if o.selection == "declared" else " (stopped at the first failure)"
        if o.shared_with:
            failing += f" (the run of `{o.shared_with}`)"
        lines.append(f"| `{o.entry.spec}` ({o.entry.bug}) | {o.entry.expected} | {o.verdict} | "
                     f"{len(o.judged)} (+{len(o.not_judged)} not judged) | {failing} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", action="append", choices=sorted(PATHS), help="only these paths (repeatable)")
    parser.add_argument("--only", action="append", metavar="PATH:NAME", help="only these implementations")
    parser.add_argument("--corpus", action="store_true",
                        help="also the publicly reported bugs of examples/conformance/corpus/<path>.py")
    parser.add_argument("--tests", nargs="*", default=["parity/test_parity.py"],
                        help="what each run collects (default: the check catalogue, parity/test_parity.py)")
    parser.add_argument("--markdown", help="write the table here too")
    parser.add_argument("--json", help="write every outcome here")
    parser.add_argument("--full", action="store_true",
                        help="judge every buggy implementation over every check of its path (the whole table); by "
                             "default a zoo bug's run stops at its first failing check and a reported bug's run "
                             "judges the checks its report declares: enough to decide each verdict")
    parser.add_argument("--fresh", action="store_true",
                        help="run each implementation in a new interpreter, not in a process forked from this one")
    args, extra = parser.parse_known_args(argv)
    sys.path[:0] = [str(Path(__file__).resolve().parent), os.getcwd()]  # the zoo modules; the suite's checkout
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent),
                                                             os.environ.get("PYTHONPATH")]))
    todo = entries(args.path or list(PATHS), corpus=args.corpus)
    if args.only:
        todo = [e for e in todo if f"{e.path}:{e.name}" in args.only]
    outcomes: list[Outcome] = []
    runs: dict[tuple[Any, ...], Outcome] = {}
    runner = Runner(fresh=args.fresh)
    ids: dict[str, set[str]] = {}  # path -> its CPU checks' ids
    for entry in todo:
        key = entry.run_key(args.full)
        first = runs.get(key) or runs.get((*key[:2], "all", ()))  # a whole run decides any verdict
        if first is None:
            outcome = runs[key] = judge(entry, args.tests, extra, runner, args.full)
        else:
            outcome = dataclasses.replace(first, entry=entry, shared_with=first.entry.spec)
        if entry.path not in ids:
            ids[entry.path] = set(catalogue_forked(entry.path))
        if outcome.selection == "all":  # a run that stopped early, or judged a report's checks, left the rest
            outcome.missing = sorted(ids[entry.path] - set(outcome.judged) - set(outcome.not_judged))
        outcomes.append(outcome)
        mark = "ok" if outcome.as_expected else "UNEXPECTED"
        took = f"the run of {outcome.shared_with}" if outcome.shared_with else f"{outcome.seconds:.0f} s"
        print(f"zoo: {entry.spec}: {outcome.verdict} ({len(outcome.failing)} failing of {len(outcome.judged)} "
              f"judged, {took}) [{mark}]", flush=True)
        if outcome.unmet:
            print(f"zoo: {entry.spec}: declared checks not failed: {', '.join(outcome.unmet)}", file=sys.stderr)
        if not outcome.as_expected:
            print(outcome.output, file=sys.stderr)
    text = table(outcomes)
    print(text)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text + "\n")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([{"implementation": o.entry.spec, "expected": o.entry.expected,
                                                "verdict": o.verdict, "bug": o.entry.bug, "failing": o.failing,
                                                "judged": o.judged, "not_judged": o.not_judged,
                                                "missing": o.missing, "declared": list(o.entry.checks),
                                                "unmet": o.unmet, "shared_with": o.shared_with,
                                                "seconds": round(o.seconds, 1)} for o in outcomes],
                                              indent=1) + "\n")
    wrong = [o.entry.spec for o in outcomes if not o.as_expected]
    if wrong:
        print(f"zoo: UNEXPECTED outcomes: {', '.join(wrong)}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
