"""The coverage pass: run the selected tests once under coverage.py and map each line to its tests.

Runs in a subprocess (``python -m mutation.engine.coverage_map OUT -- PYTEST_ARGS``) so the
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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CoverageMap", "collect"]


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


_ENGINE_FILES = {"tests/test_mutation_engine.py"}  # the engine's own files do not change what tests cover


def _fingerprint(repo: Path, files: list[str], pytest_args: list[str], roots: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps([files, pytest_args, list(roots)]).encode())
    sources = sorted(p for root in roots for p in (repo / root).rglob("*.py")
                     if ".venv" not in p.parts and p.relative_to(repo).as_posix() not in _ENGINE_FILES
                     and not p.relative_to(repo).as_posix().startswith("mutation/engine/"))
    sources += [repo / "conftest.py", repo / "pyproject.toml"]
    for path in sources:
        if path.is_file():
            digest.update(str(path.relative_to(repo)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:20]


def collect(repo: Path, files: list[str], pytest_args: list[str], roots: tuple[str, ...], *,
            cache_dir: Path, env: dict[str, str], log: callable = print) -> CoverageMap:
    """The coverage map of ``files`` (repo-relative) under ``pytest_args``; cached by source hash."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    cached = cache_dir / f"coverage-{_fingerprint(repo, files, pytest_args, roots)}.json"
    if cached.is_file():
        log(f"coverage: reusing {cached.relative_to(repo) if cached.is_relative_to(repo) else cached}")
        return CoverageMap.from_json(json.loads(cached.read_text()))
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mutcov-") as tmp:
        spec = {"files": [str(repo / f) for f in files], "roots": list(roots), "tmp": tmp}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        log(f"coverage: running {' '.join(pytest_args)} once under coverage.py")
        proc = _run_pass([sys.executable, "-m", "mutation.engine.coverage_map", tmp, "--", *pytest_args], repo, env)
        result = Path(tmp) / "map.json"
        if not result.is_file():
            raise RuntimeError(f"the coverage pass failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
        data = json.loads(result.read_text())
    if data["exit"] not in (0, 1) or not data["durations"]:  # 1: some tests failed (they never kill); else broken
        raise RuntimeError(f"the coverage pass ran {len(data['durations'])} tests and pytest exited {data['exit']} "
                           f"(a collection or usage error?):\n{proc.stdout[-4000:]}")
    data["seconds"] = time.perf_counter() - began
    coverage_map = CoverageMap.from_json(data)
    coverage_map.lines = {_relative(repo, f): ls for f, ls in coverage_map.lines.items()}
    coverage_map.caches = {_relative(repo, f): ls for f, ls in coverage_map.caches.items()}
    cached.write_text(json.dumps(coverage_map.to_json()))
    log(f"coverage: {len(coverage_map.durations)} tests in {coverage_map.seconds:.0f} s "
        f"({len(coverage_map.failing)} not passing, never used to kill)")
    return coverage_map


def _run_pass(command: list[str], repo: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The coverage pass in its own process group, so an interrupt takes its world ranks down with it."""
    with tempfile.TemporaryFile("w+") as output:
        proc = subprocess.Popen(command, cwd=repo, env=env, stdout=output, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            code = proc.wait()
        except BaseException:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        output.seek(0)
        return subprocess.CompletedProcess(command, code, output.read(), None)


def _relative(repo: Path, file: str) -> str:
    path = Path(file)
    return str(path.relative_to(repo)) if path.is_relative_to(repo) else str(path)


def _expand(contexts: set[str], cache_uses: dict[str, list[str]], tests: set[str]) -> set[str]:
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

    from mutation.engine.covplugin import CoveragePass

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
        lines[file] = {line: sorted(_expand(set(contexts), info["cache_uses"], tests))
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
