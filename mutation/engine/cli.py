"""``scripts/mutation-score``: mutate the implementations, run the tests that cover each mutant, score.

Steps: (1) the coverage pass maps each line of the target modules to the passing tests that run it
(cached by source hash); (2) every mutant of the targets is generated (``--sample``: a seeded sample,
stratified over paths and modules); (3) the reviewed equivalent mutants are set aside; (4) the rest
run in forked children, each against its own covering tests; (5) JSON and markdown reports.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import tomllib
from collections import defaultdict
from pathlib import Path

from mutation.engine import report
from mutation.engine.coverage_map import CoverageMap, collect
from mutation.engine.operators import Mutant, find_mutants
from mutation.engine.runner import job_for

__all__ = ["PATHS", "main"]

REPO = Path(__file__).resolve().parents[2]
PATHS: dict[str, list[str]] = {
    "replay": ["harness/replay"], "ar": ["harness/ar"], "decode": ["harness/decode"],
    "attention": ["harness/attention"], "compare": ["harness/compare.py", "harness/growth.py"],
}
ROOTS = ("harness", "fakes", "fixtures", "parity", "mutation", "gpu", "tests")
DEFAULT_PYTEST = ["-m", "cpu", "-q"]
SAMPLE_SIZE = 50
TEST_BUDGET_S = 6.0   # baseline seconds of tests one mutant may run (fastest first)
MAX_TESTS = 12
FOCUSED_TESTS = 4     # of those, slots for the tests most focused on the mutated module (its unit tests)
EQUIVALENTS = REPO / "mutation" / "equivalent_mutants.toml"


def _log(message: str) -> None:
    print(f"[mutation-score {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="mutation-score", description=__doc__.splitlines()[0])
    parser.add_argument("--path", action="append", choices=sorted(PATHS),
                        help="a path to mutate (repeatable; default: all five)")
    parser.add_argument("--module", action="append", default=[],
                        help="an importable module to mutate instead (a user's own implementation)")
    parser.add_argument("--sample", action="store_true", help=f"a seeded, stratified sample of {SAMPLE_SIZE}")
    parser.add_argument("--sample-size", type=int, default=SAMPLE_SIZE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", action="append", default=[], metavar="FILE:LINE[:OPERATOR]",
                        help="run only the mutants at this place (repeatable): to check that a new test kills them")
    parser.add_argument("--json", type=Path, help="write the JSON report here")
    parser.add_argument("--md", type=Path, help="write the markdown report here")
    parser.add_argument("--fail-under", type=float, default=None,
                        help="exit 1 when the score is below this (the CI gate uses 0.90 with --sample)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="mutants run at once")
    parser.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                        help="start no mutant after this many seconds; the rest are reported as not run")
    parser.add_argument("--equivalents", type=Path, default=EQUIVALENTS)
    parser.add_argument("--cache-dir", type=Path, default=REPO / "reports" / "mutation-cache",
                        help="where the coverage map is cached (keyed by the hash of the sources)")
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    if args.module and args.path:
        parser.error("--module and --path are exclusive: --module mutates a module with the current selection")
    if args.sample_size < 1:
        parser.error(f"--sample-size must be >= 1, got {args.sample_size}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    pytest_args = argv[split + 1:] or list(DEFAULT_PYTEST)
    return args, pytest_args


def _display(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


def targets(paths: list[str], modules: list[str]) -> list[tuple[str, str, Path, str]]:
    """(group, module name, file, display path) for every module to mutate."""
    found = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            raise SystemExit(f"mutation-score: --module {name!r} is not an importable Python source module")
        file = Path(spec.origin).resolve()
        found.append((name, name, file, _display(file)))
    for path in paths:
        for entry in PATHS[path]:
            base = REPO / entry
            files = sorted(base.glob("*.py")) if base.is_dir() else [base]
            found += [(path, _module_name(f), f, _display(f)) for f in files]
    return found


def _matches(mutant: Mutant, place: str) -> bool:
    parts = place.split(":")
    if len(parts) not in (2, 3) or not parts[1].isdigit():
        raise SystemExit(f"mutation-score: --only {place!r} must read FILE:LINE or FILE:LINE:OPERATOR")
    return (mutant.file == parts[0] and mutant.line == int(parts[1])
            and (len(parts) == 2 or mutant.operator == parts[2]))


def load_equivalents(path: Path) -> list[dict]:
    """The reviewed equivalent mutants: each entry has file, operator, diff and a one-line reason."""
    if not path.is_file():
        return []
    entries = tomllib.loads(path.read_text()).get("mutant", [])
    for entry in entries:
        missing = {"file", "operator", "diff", "reason"} - set(entry)
        if missing or not str(entry.get("reason", "")).strip():
            raise SystemExit(f"mutation-score: {path}: entry {entry} needs file, operator, diff and a reason "
                             f"(missing: {sorted(missing) or ['reason']})")
    return entries


def is_equivalent(mutant: Mutant, equivalents: list[dict]) -> bool:
    return any(e["file"] == mutant.file and e["operator"] == mutant.operator and e["diff"].strip() == mutant.diff
               for e in equivalents)


def sample(mutants: list[tuple[str, Mutant]], size: int, seed: int) -> list[tuple[str, Mutant]]:
    """A seeded sample stratified over groups (paths), then over modules within a group."""
    rng = random.Random(seed)
    by_group: dict[str, dict[str, list[Mutant]]] = defaultdict(lambda: defaultdict(list))
    for group, mutant in mutants:
        by_group[group][mutant.file].append(mutant)
    groups = sorted(by_group)
    quota = {g: size // len(groups) + (1 if i < size % len(groups) else 0) for i, g in enumerate(groups)}
    chosen: list[tuple[str, Mutant]] = []
    for group in groups:
        pools = {f: rng.sample(ms, len(ms)) for f, ms in sorted(by_group[group].items())}
        order = sorted(pools, key=lambda f: rng.random())
        taken = 0
        while taken < quota[group] and any(pools.values()):
            for file in order:
                if pools[file] and taken < quota[group]:
                    chosen.append((group, pools[file].pop()))
                    taken += 1
    return chosen


def select_tests(mutant: Mutant, coverage_map: CoverageMap, source_lines: dict[str, list[str]]) -> list[str]:
    """The passing tests that run the mutated line, capped: first the ones most focused on the mutated module
    (its unit tests, which a line run by hundreds of end-to-end tests would otherwise never reach), then the
    fastest, round robin over test files; run fastest first."""
    if mutant.scope == "global":
        covering: set[str] = set()
        for file, lines in source_lines.items():
            for number, text in enumerate(lines, start=1):
                if mutant.qualname in text and number != mutant.line:
                    covering.update(coverage_map.tests_for(file, number))
        named = re.compile(rf"\b{re.escape(mutant.qualname)}\b")
        failing = set(coverage_map.failing)
        covering.update(t for t in coverage_map.durations
                        if t not in failing and named.search(_test_file_text(t.split("::")[0])))
    else:
        covering = set(coverage_map.tests_for(mutant.file, mutant.line))
    durations = coverage_map.durations
    focused = sorted(covering, key=lambda t: (-coverage_map.focus(t, mutant.file), durations.get(t, 0.0), t))
    by_file: dict[str, list[str]] = defaultdict(list)
    for test in sorted(covering, key=lambda t: (durations.get(t, 0.0), t)):
        by_file[test.split("::")[0]].append(test)
    ordered: list[str] = focused[:FOCUSED_TESTS]
    files = sorted(by_file, key=lambda f: durations.get(by_file[f][0], 0.0))
    while any(by_file.values()):
        for file in files:
            if by_file[file]:
                ordered.append(by_file[file].pop(0))
    chosen, spent = [], 0.0
    for test in dict.fromkeys(ordered):
        if len(chosen) >= MAX_TESTS or (chosen and spent + durations.get(test, 0.0) > TEST_BUDGET_S):
            continue
        chosen.append(test)
        spent += durations.get(test, 0.0)
    return sorted(chosen, key=lambda t: (durations.get(t, 0.0), t))


@functools.cache
def _test_file_text(path: str) -> str:
    """A test file's source: a module constant's tests include the tests of every file that names it."""
    file = REPO / path
    return file.read_text() if file.is_file() else ""


def _environment(extra_roots: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    env["PARITY_THREADS"] = "1"   # forked children: a started OpenMP pool deadlocks after fork
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("HYPOTHESIS_PROFILE", "ci")
    paths = [str(REPO), *extra_roots, env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def main(argv: list[str] | None = None) -> int:
    args, pytest_args = _parse(sys.argv[1:] if argv is None else argv)
    began = time.perf_counter()
    paths = [] if args.module else (args.path or sorted(PATHS))
    found = targets(paths, args.module)
    roots = tuple(dict.fromkeys([*ROOTS, *(m.split(".")[0] for m in args.module)]))
    env = _environment([])
    covered = sorted({str(f) for _, _, f, _ in [*targets(sorted(PATHS), []), *found]})  # one map serves every --path
    coverage_map = collect(REPO, covered, pytest_args, roots, cache_dir=args.cache_dir, env=env, log=_log)
    coverage_map.lines = {(_display(REPO / f) if not Path(f).is_absolute() else _display(Path(f))): ls
                          for f, ls in coverage_map.lines.items()}
    mutants: list[tuple[str, Mutant]] = []
    source_lines: dict[str, list[str]] = {}
    for group, module, file, display in found:
        source = file.read_text()
        source_lines[display] = source.splitlines()
        mutants += [(group, m) for m in find_mutants(source, module=module, file=display)]
    _log(f"{len(mutants)} mutants in {len(found)} modules")
    if args.only:
        mutants = [(g, m) for g, m in mutants if any(_matches(m, place) for place in args.only)]
        _log(f"--only: {len(mutants)} mutants")
    if args.sample:
        mutants = sample(mutants, args.sample_size, args.seed)
        _log(f"sample: {len(mutants)} mutants (seed {args.seed})")
    equivalents = load_equivalents(args.equivalents)
    results: dict[int, dict] = {}
    uncovered: set[tuple[str, int]] = set()
    jobs = []
    for position, (_, mutant) in enumerate(mutants):
        row = {"file": mutant.file, "line": mutant.line, "operator": mutant.operator, "diff": mutant.diff,
               "status": "", "killed_by": []}
        results[position] = row
        if is_equivalent(mutant, equivalents):
            row["status"] = "equivalent"
            continue
        tests = select_tests(mutant, coverage_map, source_lines)
        if not tests:
            row["status"] = "survived"  # no passing test runs this line: nothing can kill it
            uncovered.add((mutant.file, mutant.line))
            continue
        budget = sum(coverage_map.durations.get(t, 0.0) for t in tests)
        stale = ["*"] if mutant.scope == "global" else coverage_map.stale_caches(mutant.file, mutant.line)
        jobs.append(job_for(mutant, tests, 2.0 * budget + 20.0, position, stale))
    _log(f"running {len(jobs)} mutants on {args.jobs} workers "
         f"({sum(1 for r in results.values() if r['status'] == 'survived')} uncovered, "
         f"{sum(1 for r in results.values() if r['status'] == 'equivalent')} equivalent)")
    elapsed = time.perf_counter() - began
    random.Random(args.seed).shuffle(jobs)  # a run cut by --time-limit still measures a uniform sample
    warm = warm_tests(coverage_map)
    spec = {"jobs": jobs, "warm": warm, "log_dir": str(args.cache_dir / "logs"),
            "baseline": {t: coverage_map.durations.get(t, 0.0) for t in warm},
            "stop_at": None if args.time_limit is None else time.time() + args.time_limit - elapsed}
    errors = _run(spec, pytest_args, roots, args.jobs, env, results,
                  args.cache_dir / "last-run.jsonl")
    doc = report.document([r for r in results.values() if r["status"] in report.STATUSES])
    seconds = time.perf_counter() - began
    selection = "a seeded stratified sample" if args.sample else "every mutant"
    notes = [f"{selection} of {', '.join(paths) or ', '.join(args.module)}; pytest `{' '.join(pytest_args)}`; "
             f"{args.jobs} workers; {seconds:.0f} s in all (coverage pass {coverage_map.seconds:.0f} s)",
             f"tests per mutant: the passing tests that execute its line (coverage contexts, world ranks and "
             f"cached fixtures included): the {FOCUSED_TESTS} most focused on its module, then the fastest, "
             f"round robin over test files, at most {MAX_TESTS} "
             f"tests / {TEST_BUDGET_S:.0f} s of baseline time; a test that killed a mutant of the same function "
             "runs first; stop at the first failure; deadline 2 x the tests' baseline time + 20 s",
             "a killing test is re-run unmutated once; a test that fails there kills nothing",
             "a mutant on a line no passing test executes counts as survived"]
    if errors:
        notes.append(f"{errors} mutants could not be put into the live module and are not counted")
    not_run = sum(1 for r in results.values() if not r["status"])
    if not_run:
        notes.append(f"--time-limit {args.time_limit:g} s: {not_run} of {len(results)} mutants were not run and are "
                     "not counted (jobs run in a seeded random order, so the rest is a uniform sample)")
    _log(f"score {doc['score']:.4f}: {doc['killed']} killed, {doc['survived']} survived, {doc['timeout']} timeout, "
         f"{doc['equivalent']} equivalent in {seconds:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(report.markdown(doc, title="Mutation score", notes=notes, uncovered=uncovered))
    if args.fail_under is not None and doc["score"] < args.fail_under:
        _log(f"FAIL: score {doc['score']:.4f} is below --fail-under {args.fail_under}")
        return 1
    return 0


def warm_tests(coverage_map: CoverageMap) -> list[str]:
    """The fastest passing test behind each cache: run once before forking, they fill the shared caches."""
    durations = coverage_map.durations
    passing = set(durations) - set(coverage_map.failing)
    chosen: set[str] = set()
    for label in coverage_map.cache_users:
        users: set[str] = set()
        todo, seen = [label], set()
        while todo:
            context = todo.pop()
            if context in seen:
                continue
            seen.add(context)
            if context.startswith("cache:"):
                todo.extend(coverage_map.cache_users.get(context, []))
            elif context in passing:
                users.add(context)
        if users and not users & chosen:
            chosen.add(min(users, key=lambda t: (durations.get(t, 0.0), t)))
    return sorted(chosen, key=lambda t: (durations.get(t, 0.0), t))


def _run(spec: dict, pytest_args: list[str], roots: tuple[str, ...], workers: int, env: dict[str, str],
         results: dict[int, dict], log_file: Path | None = None) -> int:
    """Run the jobs in the runner subprocess; fill ``results``; return how many mutants errored."""
    jobs = spec["jobs"]
    if not jobs:
        return 0
    with tempfile.TemporaryDirectory(prefix="mutjobs-") as tmp:
        jobs_file, results_file = Path(tmp) / "jobs.json", Path(tmp) / "results.jsonl"
        jobs_file.write_text(json.dumps(spec))
        results_file.touch()
        tests = {t for job in jobs for t in job["tests"]} | set(spec["warm"])
        test_files = sorted({t.split("::")[0] for t in tests})
        command = [sys.executable, "-m", "mutation.engine.runner", str(jobs_file), str(results_file), str(workers),
                   ",".join(roots), "--", *pytest_args, *test_files]
        err_file = Path(tmp) / "runner.err"
        with err_file.open("w") as err:
            proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
            shown, last = 0, time.monotonic()
            while proc.poll() is None:
                time.sleep(1.0)
                notes = [n for n in err_file.read_text().splitlines() if n.startswith("runner:")]
                for note in notes[shown:]:
                    _log(note)
                shown = len(notes)
                if time.monotonic() - last > 30:
                    _log(f"{len(results_file.read_text().splitlines())} / {len(jobs)} mutants done")
                    last = time.monotonic()
        stderr = err_file.read_text()
        records = [json.loads(line) for line in results_file.read_text().splitlines()]
        if log_file is not None:  # per-mutant seconds and test counts, for tuning and debugging
            log_file.parent.mkdir(parents=True, exist_ok=True)
            log_file.write_text(results_file.read_text())
    errors = 0
    for record in records:
        row = results[record["id"]]
        if record["status"] == "error":
            row["status"] = "error"
            errors += 1
            _log(f"not applied: {row['file']}:{row['line']} {row['operator']}: {record.get('error')}")
            continue
        row["status"] = record["status"]
        row["killed_by"] = record["killed_by"]
    missing = [job["id"] for job in jobs if not results[job["id"]]["status"]]
    if missing and "time limit reached" not in stderr:
        raise SystemExit(f"mutation-score: the runner stopped before {len(missing)} mutants finished "
                         f"(exit {proc.returncode}):\n{stderr[-4000:]}")
    return errors


if __name__ == "__main__":
    sys.exit(main())
