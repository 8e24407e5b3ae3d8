"""The end of a run: its exit status, the report written and its section in the terminal summary."""

from __future__ import annotations

import os
from typing import Any

import pytest

from harness import workers
from harness.given_inputs import IDLE_KEY, idle_inputs
from harness.placement import reporting_rank, summarise_placement
from harness.plugins import conformance
from harness.plugins.conformance_run import (
    GUARDED_KEY,
    NOT_JUDGED_KEY,
    OWN_TESTS_KEY,
    guarded_lines,
    never_ran,
    not_judged_lines,
)
from harness.process import lifecycle
from harness.reports import report
from harness.session import SESSION_KEY

__all__ = ["InterruptTraceback", "finish", "interrupted_line", "not_green_line", "write_summary"]


class InterruptTraceback:
    """Keeps a stop quick: pytest formats the whole traceback of an interrupt, reading and parsing the source of every
    frame (torch's largest files among them), to print one line of it unless ``--full-trace``. A stopped split run's
    controller and workers were found still doing that, seconds after their ranks were gone. So the frames before
    the one pytest prints are dropped first; that line, and the full trace when asked for, are unchanged."""

    def __init__(self, config: pytest.Config) -> None:
        self.full_trace = bool(config.option.fulltrace)

    @pytest.hookimpl(tryfirst=True)
    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        if self.full_trace:
            return
        frames = excinfo.traceback
        shown = next((i for i in range(len(frames) - 1, -1, -1) if not frames[i].ishidden(excinfo)), None)
        if shown is not None:
            excinfo.traceback = frames[shown:]


def finish(session: pytest.Session) -> None:
    """The run's exit status and report: checks that never called the implementation under test, inputs nothing ran
    on, an interrupt, a report that could not be written; the report is built once, by the reporting rank."""
    parity = session.config.stash.get(SESSION_KEY, None)
    if parity is None:
        return
    if workers.is_worker(session.config):  # the controller judges the whole run (harness.workers)
        workers.ship(session.config, conformance.call_counts())
        return
    problems = never_ran(session.config, {v.path for v in parity.verdicts.values()},
                         workers.merged_calls(session.config))
    if problems:
        parity.conformance_problems = problems
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    # an input no check ran on judged nothing: exit 1 like a failed check, not 5 ("no tests collected"), which
    # lanes often tolerate, and items were collected; a run already failing keeps its own status
    idle = session.config.stash[IDLE_KEY] = idle_inputs(session.config)
    if idle and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    interrupted = session.exitstatus == pytest.ExitCode.INTERRUPTED
    # an interrupted run given --parity-report writes it even when it holds nothing (a split run's controller holds
    # only what finished workers handed it): a report left from an earlier run must never stand for this one
    stale = interrupted and bool(session.config.getoption("parity_report"))
    if reporting_rank() and (parity.verdicts or parity.kills or parity.unfinished or parity.pairs_unfinished or idle
                             or parity.benchmarks or stale):
        parity.report_data = parity.report()
        if idle:
            parity.report_data["nothing_ran"] = idle
        if interrupted:
            parity.report_data["interrupted"] = interrupted_line()
        why = not_green_line(int(session.exitstatus), parity.report_data, parity.other_failures,
                             parity.conformance_problems)
        if why:
            parity.report_data["not_green"] = why
        for path in session.config.getoption("parity_report") or []:
            try:
                parity.written.append(os.fspath(report.write(parity.report_data, path)))
            except OSError as err:  # checked at configure; the disk may still fill up or go away
                parity.write_errors.append(f"--parity-report {path}: not written ({type(err).__name__}: "
                                           f"{err.strerror or err})")
        if parity.write_errors:
            session.exitstatus = pytest.ExitCode.INTERNAL_ERROR
    parity.exitstatus = int(session.exitstatus)


def not_green_line(exitstatus: int, data: dict[str, Any], other_failures: list[str],
                   conformance_problems: list[str]) -> str | None:
    """What a report says first when pytest exits non-zero while its own tables read green (every check passed,
    every pair killed): the exit status and why, e.g. a test outside the parity checks that failed. None when the
    run is green or the report already shows what failed."""
    summary = data["summary"]
    shown = (summary["failed"] or summary["pairs_survived"] or summary["pairs_failed"] or data.get("interrupted")
             or data.get("nothing_ran"))
    if exitstatus == pytest.ExitCode.OK or shown:
        return None
    why = []
    if other_failures:
        why.append(f"{len(other_failures)} test(s) outside the parity checks failed: {', '.join(other_failures)}")
    why += conformance_problems
    if not why:
        why.append("an error outside any test (collection, usage or an internal error: see pytest's own summary)")
    try:
        name = f" ({pytest.ExitCode(exitstatus).name.lower().replace('_', ' ')})"
    except ValueError:  # a status a plugin set that pytest does not name
        name = ""
    return f"NOT GREEN: pytest exits {exitstatus}{name}; " + "; ".join(why)


def interrupted_line() -> str:
    """What a report of an interrupted run says first: which signal stopped it, and that it covers only part."""
    asked = lifecycle.requested()
    how = "by Ctrl-C" if asked in ("", "SIGINT") else f"by {asked}"
    return (f"INTERRUPTED {how}: the run stopped before every item ran; this report holds only what finished, and "
            "the run is not green")


def write_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """The report's terminal section: the table, what failed outside it, what a conformance run left unjudged."""
    session = config.stash.get(SESSION_KEY, None)
    idle = config.stash.get(IDLE_KEY, [])
    if session is not None and session.benchmarks and reporting_rank():
        terminalreporter.section("fastpath-parity benchmarks")
        for line in session.benchmarks.lines():
            terminalreporter.write_line(line)
    if session is None or (session.report_data is None and not idle):
        return
    judged = session.report_data is not None and bool(session.report_data["checks"] or session.report_data["ablations"]
                                                      or not session.benchmarks)  # a bench-only run judged nothing
    if not (judged or idle or session.written or session.write_errors):
        return
    terminalreporter.section("fastpath-parity report")
    if judged:
        terminalreporter.write_line(report.render_terminal(session.report_data))
    for problem in session.conformance_problems:
        terminalreporter.write_line(f"FAILED {problem}", red=True)
    for line in idle:
        terminalreporter.write_line(f"FAILED {line}", red=True)
    for line in not_judged_lines(config.stash.get(NOT_JUDGED_KEY, {}), config.stash.get(OWN_TESTS_KEY, {})):
        terminalreporter.write_line(line, yellow=True)
    for line in guarded_lines(config.stash.get(GUARDED_KEY, {})):
        terminalreporter.write_line(line, yellow=True)
    for written in session.written:
        terminalreporter.write_line(f"parity report written to {written}")
    for problem in session.write_errors:
        terminalreporter.write_line(f"ERROR {problem}", red=True)
    summarise_placement(terminalreporter)
