"""``scripts/mutation-score``: mutate the implementations, run the tests that cover each mutant, score.

Steps: (1) the coverage pass maps each line of harness/ to the passing tests that run it (cached by
source hash); (2) every mutant of the targets is generated and the reviewed equivalent mutants are set
aside (an entry whose line changed is stale and fails the run); (3) ``--sample`` draws a sample seeded by
the commit, stratified over modules in proportion to their mutants; (4) each mutant runs in a forked child
against a capped first pass of its covering tests, and a survivor again against all of them; (5) JSON and
markdown reports.
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import importlib.util
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from harness.process.progress_lines import Meter
from tools.mutation_score import equivalents, report
from tools.mutation_score.coverage_map import SHARD_SECONDS, CoverageMap, collect, expand_contexts, file_seconds
from tools.mutation_score.operators import Mutant, find_mutants, parsed
from tools.mutation_score.runner import job_for

__all__ = ["PATHS", "main"]

REPO = Path(__file__).resolve().parents[2]
# What the score covers: the implementation code of harness/, i.e. what computes a path's result or judges it.
# The four paths recursively (their families, backends, VAEs and kernels, and the register functions the suite
# ships through its entry points), the comparison policies and growth budget, the checkpoint kinds (the suite's
# `checkpoints` plugin) and the conformance plumbing (which implementation a verdict is about). The machinery
# that runs the tests is not mutated: the pytest plugin's modules (harness/*.py), the check/ablation registries and
# catalogue (harness/judging/checks.py, ablation.py, catalogue.py; harness/plugins/entry_points.py) run at
# collection, before the forked children exist, so their mutants would never run, and they judge the very session a
# mutant runs in; the processes (harness/process/), device placement on GPUs (inputs/device_map.py), version shims
# for the other stack (inputs/compat.py, half of whose branches never run on one lock) and report rendering
# (harness/reports/) are held by their own unit tests in tests/.
PATHS: dict[str, list[str]] = {
    "replay": ["harness/replay"], "ar": ["harness/ar"], "decode": ["harness/decode"],
    "attention": ["harness/attention"], "compare": ["harness/judging/compare.py", "harness/judging/growth.py"],
    "suite": ["harness/inputs/checkpoints.py", "harness/plugins/conformance.py", "harness/plugins/declarations.py",
              "harness/judging/space.py"],
}
ROOTS = ("harness", "fakes", "fixtures", "parity", "mutation", "gpu", "tests")
DEFAULT_PYTEST = ["-m", "cpu", "-q"]
SAMPLE_SIZE = 100
TEST_BUDGET_S = 6.0   # first pass: baseline seconds of tests one mutant may run (fastest first)
MAX_TESTS = 12
FOCUSED_TESTS = 4     # of those, slots for the tests most focused on the mutated module (its unit tests)
MAX_ERRORS = 0        # mutants that cannot be put into the live module: each is a hole in the measurement
EQUIVALENTS = Path(__file__).resolve().parent / "equivalent_mutants.toml"
STAGES = 2  # the coverage pass, then the mutants (each in a capped first pass, a survivor in a second one)
PROGRESS_S = 15.0  # how often a stage's progress is said on stderr


def _log(message: str) -> None:
    print(f"[mutation-score {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="mutation-score", description=__doc__.splitlines()[0])
    parser.add_argument("--path", action="append", choices=sorted(PATHS),
                        help=f"a group to mutate (repeatable; default: all of {', '.join(sorted(PATHS))})")
    parser.add_argument("--module", action="append", default=[],
                        help="an importable module to mutate instead (a user's own implementation)")
    parser.add_argument("--sample", action="store_true",
                        help=f"a sample of {SAMPLE_SIZE} judged mutants, stratified over modules in proportion to "
                             "their mutants, seeded by the commit")
    parser.add_argument("--sample-size", type=int, default=SAMPLE_SIZE)
    seeds = parser.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=int, default=None,
                       help="an explicit seed (default: derived from `git rev-parse HEAD`)")
    seeds.add_argument("--seed-from", metavar="TEXT", default=None,
                       help="derive the seed from this text (a commit hash) instead of HEAD's")
    parser.add_argument("--only", action="append", default=[], metavar="FILE[:LINE[:OPERATOR]]",
                        help="run only the mutants of this file or line (repeatable): does a new test kill them?")
    parser.add_argument("--json", type=Path, help="write the JSON report here")
    parser.add_argument("--md", type=Path, help="write the markdown report here")
    parser.add_argument("--fail-under", type=float, default=None,
                        help="exit 1 when the score is below this (CI: 0.95, sample and full run)")
    parser.add_argument("--max-errors", type=int, default=MAX_ERRORS,
                        help=f"exit 1 when more mutants than this cannot be applied (default {MAX_ERRORS})")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="mutants run at once")
    parser.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                        help="start no mutant after this many seconds; the rest are reported as not run")
    parser.add_argument("--equivalents", type=Path, default=EQUIVALENTS)
    parser.add_argument("--save-shard-seconds", action="store_true",
                        help=f"record this run's seconds per test file in {_display(SHARD_SECONDS)}: a fresh "
                             "machine splits the coverage pass by them")
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
    if args.max_errors < 0:
        parser.error(f"--max-errors must be >= 0, got {args.max_errors}")
    if args.seed_from is not None and not args.seed_from.strip():
        parser.error("--seed-from needs a non-empty text (a commit hash)")
    pytest_args = argv[split + 1:] or list(DEFAULT_PYTEST)
    return args, pytest_args


def derive_seed(text: str) -> int:
    """A sample seed from a commit hash (or any text): the first 64 bits of its SHA-256."""
    return int(hashlib.sha256(text.strip().encode()).hexdigest()[:16], 16)


def sample_seed(args: argparse.Namespace, files: list[Path]) -> tuple[int, str]:
    """The seed of the sample and where it came from: ``--seed``, ``--seed-from``, the commit checked out, or,
    outside a git checkout, the hash of the mutated sources (so new code draws a new sample there too)."""
    if args.seed is not None:
        return args.seed, f"--seed {args.seed}"
    if args.seed_from is not None:
        return derive_seed(args.seed_from), f"derived from --seed-from {args.seed_from.strip()}"
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=30)
        commit = head.stdout.strip() if head.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        commit = ""
    if re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", commit):
        return derive_seed(commit), f"derived from commit {commit[:12]} (git rev-parse HEAD)"
    digest = hashlib.sha256()
    for file in sorted(files):
        digest.update(file.read_bytes())
    sources = digest.hexdigest()
    return derive_seed(sources), (f"derived from the hash {sources[:12]} of the mutated sources (not a git checkout, "
                                  "so no commit hash)")


def _display(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _module_name(path: Path) -> str:
    """The name the module is imported under: a package's ``__init__.py`` is the package itself (importing
    ``pkg.__init__`` would load a second copy that no test uses, and its mutants would never run)."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


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
            files = sorted(base.rglob("*.py")) if base.is_dir() else [base]
            found += [(path, _module_name(f), f, _display(f)) for f in files]
    return found


def _matches(mutant: Mutant, place: str) -> bool:
    parts = place.split(":")
    if len(parts) > 3 or (len(parts) > 1 and not parts[1].isdigit()):
        raise SystemExit(f"mutation-score: --only {place!r} must read FILE, FILE:LINE or FILE:LINE:OPERATOR")
    return (mutant.file == parts[0] and (len(parts) == 1 or mutant.line == int(parts[1]))
            and (len(parts) < 3 or mutant.operator == parts[2]))


def sample(mutants: list[tuple[str, Mutant]], size: int, seed: int) -> list[tuple[str, Mutant]]:
    """A seeded sample stratified over modules in proportion to their mutants: systematic sampling over the
    mutants laid out module by module (modules in a seeded order, mutants shuffled within each), so a module
    with n of N mutants gets floor or ceil of size * n / N of the draws and every mutant is drawn with the same
    probability size / N. No module, path or mutant is always in or always out, whatever the commit."""
    if size >= len(mutants):
        return list(mutants)
    rng = random.Random(seed)
    by_module: dict[str, list[tuple[str, Mutant]]] = defaultdict(list)
    for entry in mutants:
        by_module[entry[1].file].append(entry)
    modules = sorted(by_module)
    rng.shuffle(modules)
    laid_out = [entry for module in modules for entry in rng.sample(by_module[module], len(by_module[module]))]
    step = len(laid_out) / size
    start = rng.uniform(0, step)
    return [laid_out[min(len(laid_out) - 1, math.floor(start + k * step))] for k in range(size)]


def covering_tests(mutant: Mutant, coverage_map: CoverageMap, source_lines: dict[str, list[str]]) -> set[str]:
    """Every passing test that can notice the mutant: for a line in a function, the tests that run that line;
    for a default, the tests that run the function; for a class constant (or field default), the tests that run
    the class's code, a line reading ``.NAME`` or passing ``NAME=``, or a line constructing the class, plus the
    tests of every test file holding such a line; for a module constant, the tests that run a line naming it, plus
    the tests of every test file that names it."""
    failing = set(coverage_map.failing)
    if mutant.scope == "function":
        return set(coverage_map.tests_for(mutant.file, mutant.line))
    first, last = mutant.span
    covering: set[str] = set()
    if mutant.scope in ("default", "class"):
        for number in range(first, last + 1):
            covering.update(coverage_map.tests_for(mutant.file, number))
    carriers = _carriers(mutant, source_lines)
    if mutant.scope in ("global", "class"):
        named = _readers(mutant, carriers)
        for file, lines in source_lines.items():
            for number, text in enumerate(lines, start=1):
                if named.search(text) and not (file == mutant.file and first <= number <= last):
                    covering.update(coverage_map.tests_for(file, number))
    if mutant.scope == "global":
        # what import computed from the constant runs later without naming it: a default (``k=TOLERANCE_K``, in any
        # module that imported it) or a class-level value is read by the function or class it belongs to, so their
        # tests notice it too
        for file, lines in source_lines.items():
            for start, end, read in _default_readers(file, "\n".join(lines) + "\n"):
                if read & carriers:
                    for number in range(start, end + 1):
                        covering.update(coverage_map.tests_for(file, number))
        # a module constant's name is distinctive: a test file naming it (or a constant computed from it) uses it
        covering.update(_tests_in_files_matching(re.compile("|".join(rf"\b{re.escape(n)}\b" for n in sorted(carriers))),
                                                 coverage_map))
    if mutant.scope == "class":
        # a test that constructs the class itself, or reads the constant, runs no source line that does: a field
        # default read by an instance built only at import (a table of them) is noticed there and nowhere else
        covering.update(_tests_in_files_matching(named, coverage_map))
    return covering - failing


def _tests_in_files_matching(pattern: re.Pattern[str], coverage_map: CoverageMap) -> set[str]:
    files = {t.split("::")[0] for t in coverage_map.durations}
    naming = {f for f in files if pattern.search(_test_file_text(f))}
    return {t for t in coverage_map.durations if t.split("::")[0] in naming}


def _readers(mutant: Mutant, carriers: set[str]) -> re.Pattern[str]:
    """A line that can read a module or class constant: one naming it or a constant computed from it; for a class
    constant, one reading ``.NAME``, passing ``NAME=`` or constructing the class (a field default is read where the
    attribute is, passed or left out)."""
    if mutant.scope == "class":
        owner, _, name = mutant.qualname.rpartition(".")
        owner = owner.rpartition(".")[2]
        return re.compile(rf"\.{re.escape(name)}\b|\b{re.escape(name)}\s*=|\b{re.escape(owner)}\(")
    return re.compile("|".join(rf"\b{re.escape(n)}\b" for n in sorted(carriers)))


def read_by(mutants: list[Mutant], source_lines: dict[str, list[str]]) -> set[str]:
    """The sources whose traced lines decide which tests notice these mutants (``covering_tests``): each one's own
    file and, for a module or class constant, every source with a line that can read it (a default naming a module
    constant is such a line)."""
    files: set[str] = set()
    for mutant in mutants:
        files.add(mutant.file)
        if mutant.scope in ("global", "class"):
            named = _readers(mutant, _carriers(mutant, source_lines))
            files.update(f for f, lines in source_lines.items() if any(named.search(text) for text in lines))
    return files


def _carriers(mutant: Mutant, source_lines: dict[str, list[str]]) -> set[str]:
    """A module constant's name and the names of the module constants computed from it, transitively
    (``RESOLUTION = RESOLUTION_ULPS * EPS`` carries RESOLUTION_ULPS)."""
    names = {mutant.qualname}
    if mutant.scope != "global" or mutant.file not in source_lines:
        return names
    tree = parsed("\n".join(source_lines[mutant.file]) + "\n", mutant.file)[0]
    assignments = [node for node in tree.body
                   if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None]
    grew = True
    while grew:
        grew = False
        for node in assignments:
            if not {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)} & names:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            new = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)} - names
            if new:
                names |= new
                grew = True
    return names


@functools.cache
def _default_readers(file: str, source: str) -> tuple[tuple[int, int, frozenset[str]], ...]:
    """(first line, last line, names read) of every function whose defaults, and every class whose class-level
    values, read a name: what import evaluated once and the code reads later."""
    found = []
    for node in ast.walk(parsed(source, file)[0]):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            values = [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
        elif isinstance(node, ast.ClassDef):
            values = [s.value for s in node.body if isinstance(s, ast.Assign | ast.AnnAssign) and s.value is not None]
        else:
            continue
        read = frozenset(n.id for value in values for n in ast.walk(value) if isinstance(n, ast.Name))
        if read:
            found.append((node.lineno, node.end_lineno or node.lineno, read))
    return tuple(found)


def select_tests(mutant: Mutant, coverage_map: CoverageMap, source_lines: dict[str, list[str]],
                 covering: set[str] | None = None) -> list[str]:
    """The first pass: the covering tests, capped: first the ones most focused on the mutated module (its unit
    tests, which a line run by hundreds of end-to-end tests would otherwise never reach), then the fastest,
    round robin over test files; run fastest first. A survivor then runs against all the others."""
    if covering is None:
        covering = covering_tests(mutant, coverage_map, source_lines)
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
    for test in dict.fromkeys(ordered):  # a test over the budget on its own would crowd out every fast one
        if len(chosen) >= MAX_TESTS or spent + durations.get(test, 0.0) > TEST_BUDGET_S:
            continue
        chosen.append(test)
        spent += durations.get(test, 0.0)
    if not chosen and covering:  # every covering test is over the budget: the fastest of them
        chosen = [min(covering, key=lambda t: (durations.get(t, 0.0), t))]
    return sorted(chosen, key=lambda t: (durations.get(t, 0.0), t))


@functools.cache
def _test_file_text(path: str) -> str:
    """A test file's source: a module or class constant's tests include the tests of every file that reads it."""
    file = REPO / path
    return file.read_text() if file.is_file() else ""


def _environment(extra_roots: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    env["PARITY_THREADS"] = "1"   # forked children: a started OpenMP pool deadlocks after fork
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("HYPOTHESIS_PROFILE", "mutation")  # the ci profile's examples, without shrinking a failure
    paths = [str(REPO), *extra_roots, env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def main(argv: list[str] | None = None) -> int:
    args, pytest_args = _parse(sys.argv[1:] if argv is None else argv)
    previous = signal.signal(signal.SIGTERM, _interrupted)  # a terminated run still removes its children and files
    try:
        return _main(args, pytest_args)
    except KeyboardInterrupt:
        _log("interrupted: the runner, its children and the scratch folders are gone")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _main(args: argparse.Namespace, pytest_args: list[str]) -> int:
    began = time.perf_counter()
    paths = [] if args.module else (args.path or sorted(PATHS))
    found = targets(paths, args.module)
    roots = tuple(dict.fromkeys([*ROOTS, *(m.split(".")[0] for m in args.module)]))
    env = _environment([])
    entries = equivalents.load(args.equivalents)  # a malformed file stops the run before the coverage pass
    harness_files = [f for f in (REPO / "harness").rglob("*.py") if "__pycache__" not in f.parts]
    mutants: list[tuple[str, Mutant]] = []
    # where a constant is read: any traced source, not only the mutated ones (a --path run's constant is
    # read by the other paths too)
    source_lines = {_display(f): f.read_text().splitlines() for f in harness_files}
    for group, module, file, display in found:
        source = file.read_text()
        source_lines[display] = source.splitlines()
        mutants += [(group, m) for m in find_mutants(source, module=module, file=display)]
    _log(f"{len(mutants)} mutants in {len(found)} modules")
    # matched against every mutant of the mutated files, before --only or --sample: a stale entry is found
    # whatever the selection, and an entry's count is compared with the truth
    reviewed, stale = equivalents.match([m for _, m in mutants], entries, {d for *_, d in found})
    for entry, sites in stale:
        _log(f"STALE equivalence entry ({sites} matching sites, {entry.count} reviewed): {entry.describe()}: "
             "its line changed, moved to another function or was copied; review it again")
    if args.only:
        mutants = [(g, m) for g, m in mutants if any(_matches(m, place) for place in args.only)]
        _log(f"--only: {len(mutants)} mutants")
    seed, origin = (args.seed if args.seed is not None else 0), "no sample"
    if args.sample:
        seed, origin = sample_seed(args, [f for _, _, f, _ in found])
        judged = [(g, m) for g, m in mutants if m not in reviewed]
        mutants = sample(judged, args.sample_size, seed)
        _log(f"sample: {len(mutants)} of {len(judged)} judged mutants, seed {seed} ({origin})")
    if args.sample or args.only:
        # a selection is judged by the lines its mutants can be noticed on: tracing only their sources keeps
        # the tracer out of the rest of the harness (measured on a sample: 196 s against 217 s on 2 idle cores)
        covered = sorted(read_by([m for _, m in mutants], source_lines))
    else:  # one map serves every --path and any --module under harness/: every harness source is traced
        covered = sorted(set(source_lines))
    coverage_map = collect(REPO, covered, pytest_args, roots, cache_dir=args.cache_dir, env=env, log=_log,
                           jobs=args.jobs)
    coverage_map.lines = {(_display(REPO / f) if not Path(f).is_absolute() else _display(Path(f))): ls
                          for f, ls in coverage_map.lines.items()}
    if args.save_shard_seconds:
        seconds = {f: round(t, 1) for f, t in sorted(file_seconds(coverage_map.durations).items())}
        SHARD_SECONDS.write_text(json.dumps(seconds, indent=1) + "\n")
        _log(f"recorded the seconds of {len(seconds)} test files in {_display(SHARD_SECONDS)}")
    results: dict[int, dict] = {}
    uncovered: set[tuple[str, int]] = set()
    jobs = []
    durations = coverage_map.durations
    for position, (_, mutant) in enumerate(mutants):
        row = {"file": mutant.file, "line": mutant.line, "function": mutant.qualname, "operator": mutant.operator,
               "diff": mutant.diff, "status": "", "killed_by": []}
        results[position] = row
        if mutant in reviewed:
            row["status"] = "equivalent"
            continue
        covering = covering_tests(mutant, coverage_map, source_lines)
        tests = select_tests(mutant, coverage_map, source_lines, covering)
        if not tests:
            row["status"] = "survived"  # no passing test runs this line: nothing can kill it
            uncovered.add((mutant.file, mutant.line))
            continue
        more = sorted(covering - set(tests), key=lambda t: (durations.get(t, 0.0), t))
        budget = sum(durations.get(t, 0.0) for t in tests)
        rest = sum(durations.get(t, 0.0) for t in more)
        if mutant.scope == "global":
            stale_caches = ["*"]
        else:
            lines = [mutant.line] if mutant.scope == "function" else range(mutant.span[0], mutant.span[1] + 1)
            stale_caches = sorted({c for n in lines for c in coverage_map.stale_caches(mutant.file, n)})
            if mutant.scope == "class":
                stale_caches = ["*"]  # what reads a class constant is not confined to its class's lines
        jobs.append(job_for(mutant, tests, 2.0 * budget + 20.0, position, stale_caches, more, 2.0 * rest + 20.0))
    _log(f"running {len(jobs)} mutants on {args.jobs} workers "
         f"({sum(1 for r in results.values() if r['status'] == 'survived')} uncovered, "
         f"{sum(1 for r in results.values() if r['status'] == 'equivalent')} equivalent)")
    elapsed = time.perf_counter() - began
    random.Random(seed).shuffle(jobs)  # a run cut by --time-limit still measures a uniform sample
    warm = warm_tests(coverage_map)
    spec = {"jobs": jobs, "warm": warm, "log_dir": str(args.cache_dir / "logs"),
            "baseline": {t: durations.get(t, 0.0) for t in warm},
            "stop_at": None if args.time_limit is None else time.time() + args.time_limit - elapsed}
    record = _run(spec, pytest_args, roots, args.jobs, env, results, args.cache_dir / "last-run.jsonl")
    doc = report.document([r for r in results.values() if r["status"] in report.STATUSES])
    doc["stale_equivalents"] = [{"file": e.file, "function": e.function, "operator": e.operator, "line": e.line,
                                 "mutant": e.mutant, "reviewed_sites": e.count, "matching_sites": n}
                                for e, n in stale]
    doc["selection"] = {"paths": paths, "modules": args.module, "sample": args.sample,
                        "sample_size": args.sample_size if args.sample else None, "seed": seed, "seed_origin": origin}
    seconds = time.perf_counter() - began
    second = [r for r in record if r.get("pass") == 2]
    doc["timing"] = {"seconds": round(seconds, 1), "coverage_seconds": round(coverage_map.seconds, 1),
                     "second_pass": len(second), "second_pass_kills": sum(r["status"] == "killed" for r in second)}
    selection = f"a sample stratified over modules in proportion to their mutants, seed {origin}" if args.sample \
        else "every mutant"
    notes = [f"{selection}; of {', '.join(paths) or ', '.join(args.module)}; pytest `{' '.join(pytest_args)}`; "
             f"{args.jobs} workers; {seconds:.0f} s in all (coverage pass {coverage_map.seconds:.0f} s)",
             f"tests per mutant, first pass: the passing tests that can notice it (coverage contexts, world ranks "
             f"and cached fixtures included): the {FOCUSED_TESTS} most focused on its module, then the fastest, "
             f"round robin over test files, at most {MAX_TESTS} tests / {TEST_BUDGET_S:.0f} s of baseline time (a "
             "test over that on its own waits for the second pass); a test that killed a mutant of the same function "
             "runs first; stop at the first failure; hypothesis does not shrink a counterexample",
             f"a first-pass survivor runs again against all its other covering tests before it counts as survived "
             f"(those that killed mutants of its module first): {len(second)} did, "
             f"{sum(1 for r in second if r['status'] == 'killed')} of them were killed there",
             "deadline 2 x the tests' baseline time + 20 s per pass, times the load factor the warm-up measures with "
             "full caches; a kill is re-run unmutated as it ran (the killing test after the tests that ran before it, "
             "in order); a test that fails there kills nothing",
             "a mutant no passing test can reach counts as survived"]
    if doc["errors"]:
        notes.append(f"{doc['errors']} mutants could not be put into the live module: status `error`, not in the "
                     f"score; more than {args.max_errors} fail the run")
    not_run = sum(1 for r in results.values() if not r["status"])
    if not_run:
        notes.append(f"--time-limit {args.time_limit:g} s: {not_run} of {len(results)} mutants were not run and are "
                     "not counted (jobs run in a seeded random order, so the rest is a uniform sample)")
    _log(f"score {doc['score']:.4f}: {doc['killed']} killed, {doc['survived']} survived, {doc['timeout']} timeout, "
         f"{doc['equivalent']} equivalent, {doc['errors']} errors in {seconds:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(report.markdown(doc, title="Mutation score", notes=notes, uncovered=uncovered))
    failed = False
    if args.fail_under is not None and doc["score"] < args.fail_under:
        _log(f"FAIL: score {doc['score']:.4f} is below --fail-under {args.fail_under}")
        failed = True
    if doc["errors"] > args.max_errors:
        _log(f"FAIL: {doc['errors']} mutants could not be applied (at most {args.max_errors} allowed): the score "
             "does not measure them")
        failed = True
    if stale:
        _log(f"FAIL: {len(stale)} stale equivalence entries in {_display(args.equivalents)}: review each again")
        failed = True
    return 1 if failed else 0


def warm_tests(coverage_map: CoverageMap) -> list[str]:
    """The fastest passing test behind each cache: run once before forking, they fill the shared caches."""
    durations = coverage_map.durations
    passing = set(durations) - set(coverage_map.failing)
    chosen: set[str] = set()
    for label in coverage_map.cache_users:
        users = expand_contexts({label}, coverage_map.cache_users, passing)
        if users and not users & chosen:
            chosen.add(min(users, key=lambda t: (durations.get(t, 0.0), t)))
    return sorted(chosen, key=lambda t: (durations.get(t, 0.0), t))


def _run(spec: dict, pytest_args: list[str], roots: tuple[str, ...], workers: int, env: dict[str, str],
         results: dict[int, dict], log_file: Path | None = None) -> list[dict]:
    """Run the jobs in the runner subprocess; fill ``results``; return the runner's per-mutant records."""
    jobs = spec["jobs"]
    if not jobs:
        return []
    with tempfile.TemporaryDirectory(prefix="mutjobs-") as tmp:
        jobs_file, results_file = Path(tmp) / "jobs.json", Path(tmp) / "results.jsonl"
        jobs_file.write_text(json.dumps(spec))
        results_file.touch()
        tests = {t for job in jobs for t in [*job["tests"], *job.get("more", [])]} | set(spec["warm"])
        test_files = sorted({t.split("::")[0] for t in tests})
        command = [sys.executable, "-m", "tools.mutation_score.runner", str(jobs_file), str(results_file), str(workers),
                   ",".join(roots), "--", *pytest_args, *test_files]
        err_file = Path(tmp) / "runner.err"
        with err_file.open("w") as err:
            proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
            try:
                _follow(proc, err_file, results_file, len(jobs))
            except BaseException:  # interrupted: the runner cleans up its children and scratch folder on SIGTERM
                _stop(proc)
                raise
        stderr = err_file.read_text()
        records = [json.loads(line) for line in results_file.read_text().splitlines()]
        if log_file is not None:  # per-mutant seconds and test counts, for tuning and debugging
            log_file.parent.mkdir(parents=True, exist_ok=True)
            log_file.write_text(results_file.read_text())
    for record in records:
        row = results[record["id"]]
        row["status"] = record["status"]
        row["killed_by"] = record.get("killed_by", [])
        if record["status"] == "error":
            row["error"] = record.get("error", "")
            _log(f"not applied: {row['file']}:{row['line']} {row['operator']}: {row['error']}")
    missing = [job["id"] for job in jobs if not results[job["id"]]["status"]]
    if missing and "time limit reached" not in stderr:
        raise SystemExit(f"mutation-score: the runner stopped before {len(missing)} mutants finished "
                         f"(exit {proc.returncode}):\n{stderr[-4000:]}")
    return records


def progress_detail(records: list[dict]) -> str:
    """Where the judged mutants stand: how many each pass settled, and how."""
    passes = [sum(1 for r in records if r.get("pass") == n) for n in (1, 2)]
    statuses = {status: sum(1 for r in records if r.get("status") == status)
                for status in ("killed", "survived", "timeout", "error")}
    shown = ", ".join(f"{n} {status}" for status, n in statuses.items() if n or status in ("killed", "survived"))
    return f"first pass settled {passes[0]}, second pass {passes[1]}; {shown}"


def _records_so_far(results_file: Path) -> list[dict]:
    """The runner's records written so far; a line still being written is left for the next look."""
    records = []
    for line in results_file.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _follow(proc: subprocess.Popen, err_file: Path, results_file: Path, total: int) -> None:
    """The runner's own notes as they come, and the mutants judged so far of ``total``, every PROGRESS_S."""
    shown = 0
    meter = Meter(f"mutation score: stage 2/{STAGES}, mutants", total, "mutants judged", every_s=PROGRESS_S)
    while proc.poll() is None:
        time.sleep(1.0)
        notes = [n for n in err_file.read_text().splitlines() if n.startswith("runner:")]
        for note in notes[shown:]:
            _log(note)
        shown = len(notes)
        records = _records_so_far(results_file)
        meter.update(len(records), progress_detail(records))


def _stop(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM the runner (it kills its children's process groups and removes its folder), then SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
