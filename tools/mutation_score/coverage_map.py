"""The coverage pass: run the selected tests once under coverage.py and map each line to its tests.

Runs in a subprocess (``python -m tools.mutation_score.coverage_map OUT -- PYTEST_ARGS``) so the
tracer never touches the mutation workers. The result is cached under ``.mutation-cache/`` keyed by
the hash of every project source file and the pytest arguments: a rerun on unchanged code reuses it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from harness.process.progress_lines import Meter

__all__ = ["CoverageMap", "collect", "expand_contexts"]

SHARD_SECONDS = Path(__file__).resolve().parent / "shard_seconds.json"  # refreshed by --save-shard-seconds
PROGRESS_S = 30.0  # how often the coverage pass says how many shards finished
ENGINE_TESTS = "tests/test_mutation_engine.py"  # they exercise the engine on toy modules, never harness/


@dataclass
class CoverageMap:
    """Per (repo-relative file, line): the passing tests that executed it and the caches whose computation did.

    ``cache_users`` maps a cache label to the contexts (tests or other caches) that called it, so a
    cache computed inside another one makes that one stale too.
    """

    lines: dict[str, dict[int, list[str]]]
    caches: dict[str, dict[int, list[str]]]
    cache_users: dict[str, list[str]]
    durations: dict[str, float]
    failing: list[str]
    seconds: float
    _spread: dict[str, Counter] | None = field(default=None, init=False, repr=False, compare=False)

    def tests_for(self, file: str, line: int) -> list[str]:
        return self.lines.get(file, {}).get(line, [])

    def focus(self, test: str, file: str) -> float:
        """The share of the target lines ``test`` executes that lie in ``file``: 1.0 for a unit test of that
        module, near 0 for an end-to-end test that passes through it."""
        if self._spread is None:
            spread: dict[str, Counter] = {}
            for name, by_line in self.lines.items():
                for tests in by_line.values():
                    for each in tests:
                        spread.setdefault(each, Counter())[name] += 1
            self._spread = spread
        counts = self._spread.get(test)
        return counts[file] / sum(counts.values()) if counts else 0.0

    def stale_caches(self, file: str, line: int) -> list[str]:
        """The caches whose stored values were computed through this line, directly or through another cache."""
        found: set[str] = set()
        todo = list(self.caches.get(file, {}).get(line, []))
        while todo:
            label = todo.pop()
            if label in found:
                continue
            found.add(label)
            todo.extend(c for c in self.cache_users.get(label, []) if c.startswith("cache:"))
        return sorted(found)

    def to_json(self) -> dict:
        return {"lines": {f: {str(k): v for k, v in ls.items()} for f, ls in self.lines.items()},
                "caches": {f: {str(k): v for k, v in ls.items()} for f, ls in self.caches.items()},
                "cache_users": self.cache_users, "durations": self.durations, "failing": self.failing,
                "seconds": self.seconds}

    @classmethod
    def from_json(cls, data: dict) -> CoverageMap:
        return cls({f: {int(k): v for k, v in ls.items()} for f, ls in data["lines"].items()},
                   {f: {int(k): v for k, v in ls.items()} for f, ls in data["caches"].items()},
                   data["cache_users"], data["durations"], data["failing"], data["seconds"])




def _fingerprint(repo: Path, files: list[str], pytest_args: list[str], roots: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps([files, pytest_args, list(roots)]).encode())
    sources = sorted(p for root in roots for p in (repo / root).rglob("*.py")
                     if ".venv" not in p.parts and p.relative_to(repo).as_posix() != ENGINE_TESTS
                     and not p.relative_to(repo).as_posix().startswith("tools/mutation_score/"))
    sources += [repo / "conftest.py", repo / "pyproject.toml"]
    for path in sources:
        if path.is_file():
            digest.update(str(path.relative_to(repo)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:20]


def collect(repo: Path, files: list[str], pytest_args: list[str], roots: tuple[str, ...], *,
            cache_dir: Path, env: dict[str, str], log: callable = print, jobs: int = 1) -> CoverageMap:
    """The coverage map of ``files`` (repo-relative) under ``pytest_args``; cached by source hash. With ``jobs``
    > 1 and no test paths in ``pytest_args``, the test files are split into that many shards run at once."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    cached = cache_dir / f"coverage-{_fingerprint(repo, files, pytest_args, roots)}.json"
    if cached.is_file():
        log(f"coverage: reusing {cached.relative_to(repo) if cached.is_relative_to(repo) else cached}")
        return CoverageMap.from_json(json.loads(cached.read_text()))
    began = time.perf_counter()
    shards = _shards(repo, pytest_args, jobs, cache_dir, SHARD_SECONDS)
    with tempfile.TemporaryDirectory(prefix="mutcov-") as tmp:
        log(f"coverage: running {' '.join(pytest_args)} once under coverage.py"
            + (f", in {len(shards)} shards of test files" if len(shards) > 1 else ""))
        commands, folders = [], []
        for number, shard in enumerate(shards):
            folder = Path(tmp) / f"shard{number}"
            folder.mkdir()
            spec = {"files": [str(repo / f) for f in files], "roots": list(roots), "tmp": str(folder)}
            (folder / "spec.json").write_text(json.dumps(spec))
            commands.append([sys.executable, "-m", "tools.mutation_score.coverage_map", str(folder), "--", *pytest_args,
                             *shard])
            folders.append(folder)
        outputs = _run_passes(commands, repo, env)
        parts = []
        for folder, proc in zip(folders, outputs, strict=True):
            result = folder / "map.json"
            if not result.is_file():
                raise RuntimeError(f"the coverage pass failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
            parts.append(json.loads(result.read_text()))
    data = _merge(parts)
    if any(p["exit"] not in (0, 1, 5) for p in parts) or not data["durations"]:  # 1: some tests failed (they never
        # kill); 5: a shard selected no test; anything else is broken
        raise RuntimeError(f"the coverage pass ran {len(data['durations'])} tests and pytest exited "
                           f"{[p['exit'] for p in parts]} (a collection or usage error?):\n"
                           + "\n".join(o.stdout[-2000:] for o in outputs))
    data["seconds"] = time.perf_counter() - began
    coverage_map = CoverageMap.from_json(data)
    coverage_map.lines = {_relative(repo, f): ls for f, ls in coverage_map.lines.items()}
    coverage_map.caches = {_relative(repo, f): ls for f, ls in coverage_map.caches.items()}
    cached.write_text(json.dumps(coverage_map.to_json()))
    log(f"coverage: {len(coverage_map.durations)} tests in {coverage_map.seconds:.0f} s "
        f"({len(coverage_map.failing)} not passing, never used to kill)")
    return coverage_map


def _shards(repo: Path, pytest_args: list[str], jobs: int, cache_dir: Path,
            recorded: Path | None = None) -> list[list[str]]:
    """The test files of the default selection (the engine's own tests left out: they never run harness/) split
    into ``jobs`` shards of about equal baseline time, or one shard of nothing extra when the arguments name test
    paths. The time of a file comes from the last coverage map in ``cache_dir``, else from ``recorded`` (the
    seconds per test file the repository keeps, for a fresh machine), else from its size: sizes misjudge the
    world tests by a factor of two, and the pass lasts as long as its slowest shard."""
    named = [a for a in pytest_args if not a.startswith("-") and (repo / a.split("::")[0]).exists()]
    if named:
        return [[]]
    config = tomllib.loads((repo / "pyproject.toml").read_text())
    roots = config.get("tool", {}).get("pytest", {}).get("ini_options", {}).get("testpaths", [])
    tests = sorted(str(p.relative_to(repo)) for root in roots for p in (repo / root).rglob("test_*.py")
                   if str(p.relative_to(repo)) != ENGINE_TESTS)
    size = {t: float((repo / t).stat().st_size) for t in tests}
    seconds = _recorded_seconds(cache_dir, recorded)
    known = [t for t in tests if t in seconds]
    if known:  # a file new since the record is estimated from its size at the record's seconds per byte
        rate = sum(seconds[t] for t in known) / max(1.0, sum(size[t] for t in known))
        weight = {t: seconds[t] if t in seconds else size[t] * rate for t in tests}
    else:
        weight = size
    jobs = max(1, jobs)
    shards: list[list[str]] = [[] for _ in range(jobs)]
    load = [0.0] * jobs
    for test in sorted(tests, key=lambda t: (-weight[t], t)):  # longest first, onto the lightest shard
        lightest = load.index(min(load))
        shards[lightest].append(test)
        load[lightest] += weight[test]
    return [sorted(shard) for shard in shards if shard]


def _recorded_seconds(cache_dir: Path, recorded: Path | None) -> dict[str, float]:
    """Seconds per test file: from the newest coverage map in the cache, else from the repository's record."""
    previous = sorted(cache_dir.glob("coverage-*.json"), key=lambda p: p.stat().st_mtime)
    if previous:
        with contextlib.suppress(ValueError, KeyError, OSError):
            return file_seconds(json.loads(previous[-1].read_text())["durations"])
    if recorded is not None and recorded.is_file():
        with contextlib.suppress(ValueError, OSError):
            data = json.loads(recorded.read_text())
            if isinstance(data, dict):
                return {str(k): float(v) for k, v in data.items() if isinstance(v, int | float)}
    return {}


def file_seconds(durations: dict[str, float]) -> dict[str, float]:
    """Seconds per test file from seconds per test id."""
    seconds: dict[str, float] = {}
    for test, duration in durations.items():
        file = test.split("::")[0]
        seconds[file] = seconds.get(file, 0.0) + duration
    return seconds


def _merge(parts: list[dict]) -> dict:
    """One coverage map from the shards' maps: lines, caches and cache users are unions; tests are disjoint."""
    lines: dict[str, dict[str, set[str]]] = {}
    caches: dict[str, dict[str, set[str]]] = {}
    users: dict[str, set[str]] = {}
    durations: dict[str, float] = {}
    failing: set[str] = set()
    for part in parts:
        for target, source in ((lines, part["lines"]), (caches, part["caches"])):
            for file, by_line in source.items():
                for line, names in by_line.items():
                    target.setdefault(file, {}).setdefault(str(line), set()).update(names)
        for label, contexts in part["cache_users"].items():
            users.setdefault(label, set()).update(contexts)
        durations.update(part["durations"])
        failing.update(part["failing"])
    return {"lines": {f: {k: sorted(v) for k, v in ls.items()} for f, ls in lines.items()},
            "caches": {f: {k: sorted(v) for k, v in ls.items()} for f, ls in caches.items()},
            "cache_users": {k: sorted(v) for k, v in users.items()}, "durations": durations,
            "failing": sorted(failing), "seconds": 0.0}


def _run_passes(commands: list[list[str]], repo: Path, env: dict[str, str]) -> list[subprocess.CompletedProcess]:
    """The coverage shards at once, each in its own process group, so an interrupt takes their world ranks down."""
    with contextlib.ExitStack() as stack:
        outputs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in commands]
        procs = [subprocess.Popen(c, cwd=repo, env=env, stdout=o, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True) for c, o in zip(commands, outputs, strict=True)]
        try:
            codes = _wait_all(procs)
        except BaseException:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise
        done = []
        for command, output, code in zip(commands, outputs, codes, strict=True):
            output.seek(0)
            done.append(subprocess.CompletedProcess(command, code, output.read(), None))
        return done


def _wait_all(procs: list[subprocess.Popen]) -> list[int]:
    """Every shard's exit code, saying on stderr how many of them finished while they run (minutes each)."""
    meter = Meter("mutation score: stage 1/2, coverage pass", len(procs), "shards done", every_s=PROGRESS_S)
    finished = 0
    while True:
        codes = [proc.poll() for proc in procs]
        done = sum(code is not None for code in codes)
        running = [number for number, code in enumerate(codes) if code is None]
        meter.update(done, f"running shard(s) {running}" if running else "", force=done != finished)
        finished = done
        if not running:
            return [int(code) for code in codes if code is not None]
        time.sleep(1.0)


def _relative(repo: Path, file: str) -> str:
    path = Path(file)
    return str(path.relative_to(repo)) if path.is_relative_to(repo) else str(path)


def expand_contexts(contexts: set[str], cache_uses: dict[str, list[str]], tests: set[str]) -> set[str]:
    """Test ids behind a set of contexts: ``cache:`` contexts stand for every context that used the cache."""
    found: set[str] = set()
    todo = list(contexts)
    seen: set[str] = set()
    while todo:
        context = todo.pop()
        if context in seen:
            continue
        seen.add(context)
        if context.startswith("cache:"):
            todo.extend(cache_uses.get(context, []))
        elif context in tests:
            found.add(context)
    return found


def _main(tmp: Path, pytest_args: list[str]) -> int:
    import coverage
    import pytest

    from tools.mutation_score.covplugin import CoveragePass

    spec = json.loads((tmp / "spec.json").read_text())
    cov = coverage.Coverage(data_file=str(tmp / ".coverage"), include=spec["files"],
                            config_file=False)
    cov.set_option("run:patch", ["fork", "_exit"])
    cov.set_option("run:sigterm", True)
    cov.set_option("run:parallel", True)
    plugin = CoveragePass(tuple(spec["roots"]), tmp / "tests.json")
    cov.start()
    try:
        code = pytest.main([*pytest_args, "-p", "no:cacheprovider"], plugins=[plugin])
    finally:
        cov.stop()
        cov.save()
    combined = coverage.Coverage(data_file=str(tmp / ".coverage"), config_file=False)
    combined.combine([str(tmp)], keep=False)
    data = combined.get_data()
    info = json.loads((tmp / "tests.json").read_text())
    tests = {t for t, entry in info["tests"].items() if entry["passed"]}
    lines: dict[str, dict[int, list[str]]] = {}
    caches: dict[str, dict[int, list[str]]] = {}
    for file in data.measured_files():
        by_line = data.contexts_by_lineno(file)
        lines[file] = {line: sorted(expand_contexts(set(contexts), info["cache_uses"], tests))
                       for line, contexts in by_line.items()}
        labelled = {line: sorted(c for c in contexts if c.startswith("cache:")) for line, contexts in by_line.items()}
        caches[file] = {line: labels for line, labels in labelled.items() if labels}
    result = {"lines": lines, "caches": caches, "cache_users": info["cache_uses"],
              "durations": {t: e["duration"] for t, e in info["tests"].items()},
              "failing": sorted(t for t, e in info["tests"].items() if not e["passed"]), "seconds": 0.0,
              "exit": int(code)}
    (tmp / "map.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    os.environ.setdefault("PARITY_THREADS", "1")
    sys.exit(_main(Path(argv[0]), argv[split + 1:]))
