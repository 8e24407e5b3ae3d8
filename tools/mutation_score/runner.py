"""The mutant runner: one pytest session collects once, then forks one child per mutant.

Run as ``python -m tools.mutation_score.runner SPEC.json RESULTS.jsonl WORKERS ROOTS -- PYTEST_ARGS``.
The parent collects the test items, then runs a few warm-up tests that fill the project's
functools caches (tiny models, seeded inputs), tears their fixtures down and resets the parity
session, so no verdict, world or fixture outlives the warm-up; then it freezes its objects out of the collector and
collapses its private memory into huge pages, so each fork copies little. Each child (its own process group, so
its world ranks die with it) patches the mutant into the live modules, clears the caches whose values were
computed through the mutated line (the coverage map knows them), runs only the tests selected for that mutant,
fastest first, stops at the first failure (``-x``) and reports. A mutant that survives that first,
capped pass runs again against all its other covering tests: only then is it a survivor. A child past
its deadline is killed with its group and runs once more at ``TIMEOUT_RETRY`` times the deadline (a load that
rose after the warm-up, another CI stream starting, is no verdict on the mutant): past that one too, its status is
``timeout``. A kill is run again unmutated, in a child of
its own, as it ran: the killing test after the tests that ran before it in that child, in the same order. A
test that fails there failed for something other than the mutant (a test that breaks when an earlier one
leaves state behind) and kills nothing: the mutant runs again without it. The runner's scratch folder and
every child go away with it, on an interrupt too.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import importlib
import json
import os
import select
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from tools.mutation_score.hugepages import collapse_private_memory
from tools.mutation_score.operators import Mutant, parsed
from tools.mutation_score.patching import PatchError, clear_caches, index_caches, patch_live

__all__ = ["MutantRunner"]

_CHILD: dict[str, Any] = {"failed": []}
TIMEOUT_RETRY = 3.0  # a timed-out job's second deadline, in multiples of its first


class MutantRunner:
    """The pytest plugin of the runner process (see the module docstring)."""

    def __init__(self, jobs: list[dict], results: Path, workers: int, roots: tuple[str, ...],
                 warm: list[str] | None = None, log_dir: Path | None = None,
                 baseline: dict[str, float] | None = None):
        self.jobs = jobs
        self.baseline = baseline or {}
        self.stop_at: float | None = None  # wall-clock time after which no new mutant starts
        self.slowdown = 1.0
        self.log_dir = log_dir
        self.warm = warm or []
        self.results = results
        self.workers = max(1, workers)
        self.roots = roots
        # the tests a child ran up to and including the one that killed -> whether that one fails without a mutant
        self.verified: dict[tuple[str, ...], bool] = {}
        self.unverified: dict[tuple[str, ...], list[dict]] = {}  # such a sequence -> the kills waiting on it
        self.killers: dict[tuple[str, str], dict[str, int]] = {}  # (file, function) -> test -> kills

    # ------------------------------------------------------------------ child side
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            _CHILD["failed"].append(report.nodeid)

    def _child(self, session: pytest.Session, items: list[pytest.Item], mutant: Mutant | None, stale: list[str],
               out: Path, *, stop_first: bool, timeout: float) -> None:
        started = time.monotonic()
        os.setpgid(0, 0)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's cleanup handler is not the tests'
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        log = os.open(out.with_suffix(".log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        faulthandler.dump_traceback_later(max(1.0, timeout - 2.0), exit=False, file=log)  # where a timeout hung
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:  # it writes to the real stdout that capture saved, not to fd 1
            session.config.pluginmanager.unregister(reporter)
        result: dict[str, Any]
        try:
            if mutant is not None:
                patch_live(mutant, roots=self.roots, in_place=True)
            clear_caches(self.roots, stale)
        except (PatchError, SyntaxError, ValueError, TypeError) as err:
            out.write_text(json.dumps({"status": "error", "error": f"{type(err).__name__}: {err}"}))
            os._exit(0)
        ready = time.monotonic()
        try:
            for position, item in enumerate(items):
                following = items[position + 1] if position + 1 < len(items) else None
                item.config.hook.pytest_runtest_protocol(item=item, nextitem=following)
                if _CHILD["failed"] and stop_first:
                    break
            with contextlib.suppress(Exception):
                session._setupstate.teardown_exact(None)
            failed = list(dict.fromkeys(_CHILD["failed"]))
            result = {"status": "killed" if failed else "survived", "failed": failed}
        except BaseException as err:  # noqa: BLE001 - a crash of the session under a mutant is a kill by the test
            result = {"status": "killed", "failed": list(_CHILD["failed"]) or ["<session>"],
                      "error": f"{type(err).__name__}: {err}"}
        result["phases"] = {"started": started, "setup": round(ready - started, 4),
                            "tests": round(time.monotonic() - ready, 4)}
        out.write_text(json.dumps(result))
        os._exit(0)

    # ------------------------------------------------------------------ parent side
    def _warm_up(self, session: pytest.Session, by_id: dict[str, pytest.Item]) -> None:
        """Fill the caches; measure how much slower this machine runs now than the coverage pass did.

        The measurement is a second run of the same tests, with the caches full: the first run also builds what
        the caches hold, which the coverage pass timed in whichever test came first, so it overstates the load
        (on 2 cores by 2.5 x, and every deadline of a hung mutant with it)."""
        items = [by_id[t] for t in self.warm if t in by_id]
        filled = _run_items(items)
        spent = _run_items(items)
        baseline = sum(self.baseline.get(item.nodeid, 0.0) for item in items)
        if baseline > 1.0:  # deadlines scale with the load of the machine, never below the baseline's
            self.slowdown = min(8.0, max(1.0, spent / baseline))
        print(f"runner: warm-up {len(items)} tests in {filled:.1f} s, again with full caches in {spent:.1f} s "
              f"(baseline {baseline:.1f} s); deadlines x {self.slowdown:.2f}", file=sys.__stderr__, flush=True)
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
        queue: list[dict] = [dict(job, tests=[t for t in job["tests"] if t in by_id],
                                  more=[t for t in job.get("more", []) if t in by_id]) for job in self.jobs]
        _parse_before_forking(queue)
        running: dict[int, tuple[dict, float, Path]] = {}
        tmp = Path(tempfile.mkdtemp(prefix="mutrun-"))
        index_caches(self.roots)
        # Everything alive now is frozen out of the collector: a child's collection would otherwise walk (and
        # copy-on-write) every object of the parent's models and modules, which costs more than most tests.
        gc.collect()
        gc.freeze()
        began = time.perf_counter()
        collapsed = collapse_private_memory()
        print(f"runner: {collapsed / 2**20:.0f} MiB of private memory in huge pages "
              f"({time.perf_counter() - began:.1f} s): cheaper forks", file=sys.__stderr__, flush=True)
        try:
            self._loop(session, by_id, queue, running, tmp)
        finally:  # also on an interrupt: no child, no world rank and no scratch file outlives the runner
            for pid in list(running):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
            shutil.rmtree(tmp, ignore_errors=True)
        return True

    def _loop(self, session: pytest.Session, by_id: dict[str, pytest.Item], queue: list[dict],
              running: dict[int, tuple[dict, float, Path]], tmp: Path) -> None:
        serial = 0
        handles: dict[int, int] = {}  # child pid -> its pidfd, readable once the child has exited
        with self.results.open("a") as sink:
            while queue or running or self.unverified:
                if self.stop_at is not None and time.time() > self.stop_at:
                    kept = [job for job in queue if job.get("verify")]  # a retried kill check still decides its kills
                    if len(kept) < len(queue):
                        print(f"runner: time limit reached, {len(queue) - len(kept)} mutants not run",
                              file=sys.__stderr__, flush=True)
                        queue[:] = kept
                while (queue or self.unverified) and len(running) < self.workers:
                    job = self._verify_job() if self.unverified else self._ordered(queue.pop(0))
                    if not job["tests"]:
                        self._finish(sink, job, {"status": "survived", "failed": []}, 0.0, queue)
                        continue
                    serial += 1
                    out = tmp / f"{serial}.json"
                    mutant = Mutant(**job["mutant"]) if job.get("mutant") else None
                    items = [by_id[t] for t in job["tests"]]
                    forking = time.monotonic()  # the fork itself copies the parent's page tables: it counts
                    pid = os.fork()
                    if pid == 0:
                        self._child(session, items, mutant, job.get("stale", ["*"]), out,
                                    stop_first=not job.get("verify"), timeout=job["timeout"] * self.slowdown)
                    running[pid] = (job, forking, out)
                    handles[pid] = os.pidfd_open(pid)
                _await_any(handles, running, self.slowdown)
                for pid, (job, began, out) in list(running.items()):
                    done, _ = os.waitpid(pid, os.WNOHANG)
                    elapsed = time.monotonic() - began
                    if done == 0 and elapsed < job["timeout"] * self.slowdown:
                        continue
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
                    if done == 0:
                        with contextlib.suppress(ChildProcessError):
                            os.waitpid(pid, 0)
                        result = {"status": "timeout", "failed": []}
                        if self.log_dir is not None and out.with_suffix(".log").is_file():
                            self.log_dir.mkdir(parents=True, exist_ok=True)
                            shutil.copy(out.with_suffix(".log"), self.log_dir / f"timeout-{job.get('id')}.log")
                    elif out.is_file():
                        result = json.loads(out.read_text())
                        _phases(result, began, elapsed)
                    else:
                        result = {"status": "killed", "failed": ["<crash>"]}
                    del running[pid]
                    os.close(handles.pop(pid))
                    self._finish(sink, job, result, elapsed, queue)

    def _ordered(self, job: dict) -> dict:
        """Tests that already killed a mutant of the same function go first: they are the likeliest killers. In a
        second pass (hundreds of tests, fastest first) the tests that killed mutants of the same module come next:
        a first-pass survivor there is most often killed by one of them."""
        mutant = job.get("mutant")
        if not mutant:
            return job
        counts = self.killers.get((mutant["file"], mutant["qualname"]), {})
        near = {}
        if job.get("full"):
            for (file, _), by_test in self.killers.items():
                if file == mutant["file"]:
                    for test, kills in by_test.items():
                        near[test] = near.get(test, 0) + kills
        rank = {t: (0, -counts[t]) if t in counts else (1, -near[t]) for t in job["tests"] if t in counts or t in near}
        first = sorted(rank, key=lambda t: rank[t])
        return dict(job, tests=first + [t for t in job["tests"] if t not in rank])

    def _verify_job(self) -> dict:
        """An unmutated child for the kills waiting on a verdict (all tests run, no -x): every killing test that ran
        first in its child, together; else one kill whose test ran after others, with those others before it in the
        same order, because a test can fail for what an earlier test left behind, with or without a mutant."""
        singles = sorted(key for key in self.unverified if len(key) == 1)
        keys = singles or [min(self.unverified)]
        waiting = [w for key in keys for w in self.unverified.pop(key)]
        tests = [t for key in keys for t in key]
        return {"verify": True, "keys": keys, "tests": tests, "timeout": 60.0 + 5.0 * len(tests), "waiting": waiting,
                "stale": []}

    def _finish(self, sink: Any, job: dict, result: dict, elapsed: float, queue: list[dict]) -> None:
        if result["status"] == "timeout" and not job.get("retried"):
            print(f"runner: job {job.get('id')} passed its {job['timeout'] * self.slowdown:.0f} s deadline; running it "
                  f"again at {TIMEOUT_RETRY:g} x", file=sys.__stderr__, flush=True)
            queue.insert(0, dict(job, timeout=job["timeout"] * TIMEOUT_RETRY, retried=True,
                                 first_timeout_s=round(elapsed, 2)))
            return
        if job.get("verify"):  # an unmutated run of killing tests
            failed = set(result.get("failed", []))
            for key in job["keys"]:
                self.verified[key] = result["status"] != "timeout" and key[-1] not in failed
            for waiting in job["waiting"]:
                self._finish(sink, waiting["job"], waiting["result"], waiting["elapsed"], queue)
            return
        killers = [t for t in result.get("failed", []) if t in job["tests"]]
        if result["status"] == "killed" and killers:
            test = killers[0]
            key = tuple(job["tests"][:job["tests"].index(test) + 1])  # what ran in the child, up to the kill
            if key not in self.verified:
                self.unverified.setdefault(key, []).append({"job": job, "result": result, "elapsed": elapsed})
                return
            if not self.verified[key]:  # it fails there without the mutant too: drop it and run again
                queue.insert(0, dict(job, tests=[t for t in job["tests"] if t != test]))
                return
        if result["status"] == "survived" and job.get("more"):  # the capped pass is not the verdict
            queue.insert(0, dict(job, tests=job["more"], more=[], timeout=job["more_timeout"], full=True, retried=False,
                                 first_seconds=round(elapsed, 2), first_tests=len(job["tests"])))
            return
        killed_by = killers[:1] if killers else result.get("failed", [])[:1]
        if killers and job.get("mutant"):
            counts = self.killers.setdefault((job["mutant"]["file"], job["mutant"]["qualname"]), {})
            counts[killers[0]] = counts.get(killers[0], 0) + 1
        tests = len(job["tests"]) + job.get("first_tests", 0)
        record = {"id": job["id"], "status": result["status"], "killed_by": killed_by,
                  "seconds": round(elapsed + job.get("first_seconds", 0.0), 2), "tests": tests,
                  "pass": 2 if job.get("full") else 1}
        if job.get("retried"):
            record["timed_out_once_s"] = job["first_timeout_s"]
        if result.get("error"):
            record["error"] = result["error"]
        if result.get("phases"):
            record["phases"] = result["phases"]
        sink.write(json.dumps(record) + "\n")
        sink.flush()


def _phases(result: dict, began: float, elapsed: float) -> None:
    """Where a child's seconds went (for tuning): from the fork to its first line, its patch and cache clearing, its
    tests, and from its exit to the parent's reaping it."""
    phases = result.get("phases")
    if not phases:
        return
    fork = phases.pop("started") - began
    phases["fork"] = round(fork, 4)
    phases["exit"] = round(elapsed - fork - phases["setup"] - phases["tests"], 4)


def _run_items(items: list[pytest.Item]) -> float:
    """Run the items in order in this process; return the seconds they took."""
    began = time.perf_counter()
    for position, item in enumerate(items):
        following = items[position + 1] if position + 1 < len(items) else None
        item.config.hook.pytest_runtest_protocol(item=item, nextitem=following)
    return time.perf_counter() - began


def _await_any(handles: dict[int, int], running: dict[int, tuple[dict, float, Path]], slowdown: float) -> None:
    """Block until a child exits or the nearest deadline passes (at most a second), not a fixed poll."""
    if not handles:
        return
    now = time.monotonic()
    nearest = min(began + job["timeout"] * slowdown - now for job, began, _ in running.values())
    select.select(list(handles.values()), [], [], min(1.0, max(0.0, nearest)))


def _parse_before_forking(jobs: list[dict]) -> None:
    """Parse each mutated module and find its sites once, here: every forked child inherits the result."""
    for file in sorted({job["mutant"]["file"] for job in jobs if job.get("mutant")}):
        module = next(job["mutant"]["module"] for job in jobs if job.get("mutant", {}).get("file") == file)
        with contextlib.suppress(Exception):  # a module that cannot be imported errors in its child, named
            parsed(Path(importlib.import_module(module).__file__ or "").read_text(), file)


def _reset_parity_session(config: pytest.Config) -> None:
    """A fresh parity session (no cached verdict, no started world) in place of the warm-up's one."""
    parity_plugin = sys.modules.get("harness.session")
    if parity_plugin is None:  # not this suite's session (the engine's own tests)
        return
    old = config.stash.get(parity_plugin.SESSION_KEY, None)
    if old is None:
        return
    old.close()
    fresh = parity_plugin.ParitySession(config)
    fresh.checkpoints = old.checkpoints
    config.stash[parity_plugin.SESSION_KEY] = fresh


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _interrupted)  # a terminated runner still cleans up (see pytest_runtestloop)
    split = argv.index("--")
    spec_file, results_file, workers, roots = argv[:split]
    spec = json.loads(Path(spec_file).read_text())
    if isinstance(spec, list):
        spec = {"jobs": spec}
    plugin = MutantRunner(spec["jobs"], Path(results_file), int(workers), tuple(roots.split(",")),
                          spec.get("warm"), Path(spec["log_dir"]) if spec.get("log_dir") else None,
                          spec.get("baseline"))
    plugin.stop_at = spec.get("stop_at")
    return int(pytest.main([*argv[split + 1:], "-p", "no:cacheprovider"], plugins=[plugin]))


def job_for(mutant: Mutant, tests: list[str], timeout: float, job_id: int, stale: list[str],
            more: list[str] | None = None, more_timeout: float = 0.0) -> dict:
    """A runner job: the mutant, its first-pass tests in run order and their deadline in seconds, the caches it
    makes stale, and the rest of its covering tests (and their deadline) for a second pass if it survives."""
    return {"id": job_id, "mutant": asdict(mutant), "tests": tests, "timeout": timeout, "stale": stale,
            "more": list(more or []), "more_timeout": more_timeout}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
