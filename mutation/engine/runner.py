"""The mutant runner: one pytest session collects once, then forks one child per mutant.

Run as ``python -m mutation.engine.runner SPEC.json RESULTS.jsonl WORKERS ROOTS -- PYTEST_ARGS``.
The parent collects the test items, then runs a few warm-up tests that fill the project's
functools caches (tiny models, seeded inputs), tears their fixtures down and resets the parity
session, so no verdict, world or fixture outlives the warm-up. Each child (its own process group, so its world ranks
die with it) patches the mutant into the live modules, clears the caches whose values were computed through
the mutated line (the coverage map knows them), runs only the tests selected for that mutant,
fastest first, stops at the first failure (``-x``) and reports. A child past its deadline is killed
with its group: status ``timeout``. A test that kills a mutant is run once unmutated in a child of
its own; a test that fails there cannot kill anything (its kills are re-run without it).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from mutation.engine.operators import Mutant
from mutation.engine.patching import PatchError, clear_caches, patch_live

__all__ = ["MutantRunner"]

_CHILD: dict[str, Any] = {"failed": []}


class MutantRunner:
    """The pytest plugin of the runner process (see the module docstring)."""

    def __init__(self, jobs: list[dict], results: Path, workers: int, roots: tuple[str, ...],
                 warm: list[str] | None = None):
        self.jobs = jobs
        self.warm = warm or []
        self.results = results
        self.workers = max(1, workers)
        self.roots = roots
        self.verified: dict[str, bool] = {}

    # ------------------------------------------------------------------ child side
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            _CHILD["failed"].append(report.nodeid)

    def _child(self, session: pytest.Session, items: list[pytest.Item], mutant: Mutant | None, stale: list[str],
               out: Path) -> None:
        os.setpgid(0, 0)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        result: dict[str, Any]
        try:
            if mutant is not None:
                patch_live(mutant, roots=self.roots)
            clear_caches(self.roots, stale)
        except (PatchError, SyntaxError, ValueError, TypeError) as err:
            out.write_text(json.dumps({"status": "error", "error": f"{type(err).__name__}: {err}"}))
            os._exit(0)
        try:
            for position, item in enumerate(items):
                following = items[position + 1] if position + 1 < len(items) else None
                item.config.hook.pytest_runtest_protocol(item=item, nextitem=following)
                if _CHILD["failed"]:
                    break
            with contextlib.suppress(Exception):
                session._setupstate.teardown_exact(None)
            failed = list(dict.fromkeys(_CHILD["failed"]))
            result = {"status": "killed" if failed else "survived", "failed": failed}
        except BaseException as err:  # noqa: BLE001 - a crash of the session under a mutant is a kill by the test
            result = {"status": "killed", "failed": list(_CHILD["failed"]) or ["<session>"],
                      "error": f"{type(err).__name__}: {err}"}
        out.write_text(json.dumps(result))
        os._exit(0)

    # ------------------------------------------------------------------ parent side
    def _warm_up(self, session: pytest.Session, by_id: dict[str, pytest.Item]) -> None:
        items = [by_id[t] for t in self.warm if t in by_id]
        for position, item in enumerate(items):
            following = items[position + 1] if position + 1 < len(items) else None
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=following)
        with contextlib.suppress(Exception):
            session._setupstate.teardown_exact(None)
        _reset_parity_session(session.config)
        _CHILD["failed"] = []
        session.testsfailed = 0
        session.shouldstop = session.shouldfail = False

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool:
        by_id = {item.nodeid: item for item in session.items}
        self._warm_up(session, by_id)
        queue: list[dict] = [dict(job, tests=[t for t in job["tests"] if t in by_id]) for job in self.jobs]
        running: dict[int, tuple[dict, float, Path]] = {}
        tmp = Path(tempfile.mkdtemp(prefix="mutrun-"))
        serial = 0
        with self.results.open("a") as sink:
            while queue or running:
                while queue and len(running) < self.workers:
                    job = queue.pop(0)
                    if not job["tests"]:
                        self._finish(sink, job, {"status": "survived", "failed": []}, 0.0, queue)
                        continue
                    serial += 1
                    out = tmp / f"{serial}.json"
                    mutant = Mutant(**job["mutant"]) if job.get("mutant") else None
                    items = [by_id[t] for t in job["tests"]]
                    pid = os.fork()
                    if pid == 0:
                        self._child(session, items, mutant, job.get("stale", ["*"]), out)
                    running[pid] = (job, time.monotonic(), out)
                time.sleep(0.02)
                for pid, (job, began, out) in list(running.items()):
                    done, _ = os.waitpid(pid, os.WNOHANG)
                    elapsed = time.monotonic() - began
                    if done == 0 and elapsed < job["timeout"]:
                        continue
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
                    if done == 0:
                        with contextlib.suppress(ChildProcessError):
                            os.waitpid(pid, 0)
                        result = {"status": "timeout", "failed": []}
                    elif out.is_file():
                        result = json.loads(out.read_text())
                    else:
                        result = {"status": "killed", "failed": ["<crash>"]}
                    del running[pid]
                    self._finish(sink, job, result, elapsed, queue)
        return True

    def _finish(self, sink: Any, job: dict, result: dict, elapsed: float, queue: list[dict]) -> None:
        if job.get("verify"):  # an unmutated run of one killing test
            test = job["tests"][0]
            self.verified[test] = result["status"] == "survived"
            for waiting in job["waiting"]:
                self._finish(sink, waiting["job"], waiting["result"], waiting["elapsed"], queue)
            return
        killers = [t for t in result.get("failed", []) if t in job["tests"]]
        if result["status"] == "killed" and killers:
            test = killers[0]
            if test not in self.verified:
                pending = next((q for q in queue if q.get("verify") and q["tests"] == [test]), None)
                if pending is None:
                    pending = {"verify": True, "tests": [test], "timeout": job["timeout"], "waiting": []}
                    queue.insert(0, pending)
                pending["waiting"].append({"job": job, "result": result, "elapsed": elapsed})
                return
            if not self.verified[test]:  # the test fails without the mutant: drop it and run again
                queue.insert(0, dict(job, tests=[t for t in job["tests"] if t != test]))
                return
        killed_by = killers[:1] if killers else result.get("failed", [])[:1]
        record = {"id": job["id"], "status": result["status"], "killed_by": killed_by,
                  "seconds": round(elapsed, 2), "tests": len(job["tests"])}
        if result.get("error"):
            record["error"] = result["error"]
        sink.write(json.dumps(record) + "\n")
        sink.flush()


def _reset_parity_session(config: pytest.Config) -> None:
    """A fresh parity session (no cached verdict, no started world) in place of the warm-up's one."""
    try:
        from harness import plugin as parity_plugin
    except ImportError:
        return
    old = config.stash.get(parity_plugin.SESSION_KEY, None)
    if old is None:
        return
    old.close()
    fresh = parity_plugin.ParitySession(config)
    fresh.checkpoints = old.checkpoints
    config.stash[parity_plugin.SESSION_KEY] = fresh


def main(argv: list[str]) -> int:
    split = argv.index("--")
    spec_file, results_file, workers, roots = argv[:split]
    spec = json.loads(Path(spec_file).read_text())
    if isinstance(spec, list):
        spec = {"jobs": spec}
    plugin = MutantRunner(spec["jobs"], Path(results_file), int(workers), tuple(roots.split(",")),
                          spec.get("warm"))
    return int(pytest.main([*argv[split + 1:], "-p", "no:cacheprovider"], plugins=[plugin]))


def job_for(mutant: Mutant, tests: list[str], timeout: float, job_id: int, stale: list[str]) -> dict:
    """A runner job: the mutant, its tests in run order, its deadline in seconds, the caches it makes stale."""
    return {"id": job_id, "mutant": asdict(mutant), "tests": tests, "timeout": timeout, "stale": stale}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
