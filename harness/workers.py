"""A run split over pytest-xdist workers (``-n 2``) reports as one run.

Each worker runs a share of the items and keeps its own parity session; at its end it hands what it recorded to
the controller (verdicts, kill results, items that gave none, the conformance tables, how each input's items
ended, the implementation calls it counted), and the controller merges them before it builds the one report. The
report is the one a serial run writes: rows and kill pairs are ordered by the catalogue, never by which worker
finished first. Under xdist's balanced modes (``load``, the default of ``-n``, and ``loadgroup``) a path's checks
and their kill items are one unit of work: a kill item finds its check's baseline verdict on its own worker instead
of computing it again, and what a path builds once per process (its worlds of ranks, its models, flex attention's
traced kernels) is built on one worker, not on both. Measured on 2 cores: a check per unit built decode's worlds
and traced attention's kernels on each worker, and the split gate spent a tenth more CPU.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from typing import Any

import pytest

from harness.given_inputs import run_ledger
from harness.inputs.ledger import DESELECTED, ERRORED, NOT_REACHED, RAN, SKIPPED, ItemEnd
from harness.judging import catalogue
from harness.plugins.conformance_run import GUARDED_KEY, NOT_JUDGED_KEY, OWN_TESTS_KEY
from harness.session import SESSION_KEY, ParitySession

__all__ = ["OUTPUT_KEY", "WorkerState", "check_scope", "is_worker", "make_scheduler", "merge", "merged_calls",
           "refuse_unsplittable", "ship", "wait_passively"]

OUTPUT_KEY = "fastpath_parity"  # the worker's entry in xdist's workeroutput
CALLS_KEY = pytest.StashKey[dict[str, int]]()  # the controller: implementation calls per path, over every worker
STASHED = (NOT_JUDGED_KEY, GUARDED_KEY, OWN_TESTS_KEY)  # set at collection, which every worker does alike


def wait_passively(config: pytest.Config) -> None:
    """A controller about to start workers has their OpenMP threads wait passively unless told otherwise: a thread
    that spins while it waits takes the core another worker computes on (measured on 2 cores: a split gate with
    spinning threads took longer than the serial run). How a thread waits changes no arithmetic."""
    if getattr(config.option, "numprocesses", None) and not is_worker(config):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def refuse_unsplittable(config: pytest.Config) -> None:
    """The gpu tier places its models and ranks per process (``--device-map``, torchrun), so a run given checkpoints
    is not split: a usage error naming both options, before any check runs."""
    if getattr(config.option, "numprocesses", None) and not is_worker(config) and config.getoption("checkpoint"):
        raise pytest.UsageError("--checkpoint with -n: the gpu tier places its models and ranks per process; run it "
                                "without -n (pytest-xdist)")


def is_worker(config: pytest.Config) -> bool:
    """An xdist worker: it runs items and hands its records on; the controller reports."""
    return hasattr(config, "workerinput")


class WorkerState:
    """What one worker hands the controller; pickled, since xdist's channel carries only plain data."""

    def __init__(self, parity: ParitySession, config: pytest.Config, calls: dict[str, int]):
        self.verdicts = parity.verdicts
        self.kills = parity.kills
        self.unfinished = parity.unfinished
        self.pairs_unfinished = parity.pairs_unfinished
        self.other_failures = parity.other_failures
        self.benchmarks = parity.benchmarks
        self.stashed = [config.stash.get(key, None) for key in STASHED]
        self.ledger_items = run_ledger(config).items
        self.calls = calls
        self.catalogue = catalogue.loads()


def ship(config: pytest.Config, calls: dict[str, int]) -> None:
    """At a worker's end: put its records where xdist sends them to the controller."""
    parity = config.stash.get(SESSION_KEY, None)
    if parity is not None:
        config.workeroutput[OUTPUT_KEY] = pickle.dumps(WorkerState(parity, config, calls))  # type: ignore[attr-defined]


# how far an item that consumes an input got, on the worker that ran it; the others never reached it
_PROGRESS = (NOT_REACHED, DESELECTED, ERRORED, SKIPPED, RAN)


def merge(config: pytest.Config, node: Any) -> None:
    """On the controller, when a worker goes down: add its records to the run's session."""
    parity = config.stash.get(SESSION_KEY, None)
    shipped = getattr(node, "workeroutput", {}).get(OUTPUT_KEY)
    if parity is None:
        return
    if shipped is None:  # a worker that died: what it judged is missing, and the report must not read green
        name = getattr(getattr(node, "gateway", None), "id", "a worker")
        parity.other_failures.append(f"{name} went down without handing over its records: its checks are missing "
                                     "from this report")
        return
    state: WorkerState = pickle.loads(shipped)  # a worker of this very run wrote it
    for check_modules, ablation_modules in state.catalogue:  # the report reads the catalogue the workers ran
        with contextlib.suppress(ImportError):
            catalogue.load(check_modules, ablation_modules)
    parity.verdicts.update(state.verdicts)
    for label, outcome in state.unfinished.items():
        if label not in parity.verdicts:
            parity.unfinished.setdefault(label, outcome)
    parity.kills.extend(state.kills)
    parity.pairs_unfinished.update(state.pairs_unfinished)
    parity.other_failures.extend(state.other_failures)
    for table, entry in state.benchmarks.tables.items():  # one table's items may have run on both workers
        held = parity.benchmarks.tables.setdefault(table, entry)
        if held is not entry:
            for key, row in entry.rows.items():
                held.rows.setdefault(key, row)
    for key, value in zip(STASHED, state.stashed, strict=True):
        if value is not None:
            config.stash.setdefault(key, value)
    ledger = run_ledger(config)
    for nodeid, end in state.ledger_items.items():
        held = ledger.items.get(nodeid)
        if held is None or _PROGRESS.index(end.how) > _PROGRESS.index(held.how):
            ledger.items[nodeid] = ItemEnd(end.inputs, end.how, end.reason)
    calls = config.stash.setdefault(CALLS_KEY, {})
    for path, count in state.calls.items():
        calls[path] = calls.get(path, 0) + count


def merged_calls(config: pytest.Config) -> dict[str, int]:
    """The implementation calls the workers counted, per path (empty outside a split run)."""
    return dict(config.stash.get(CALLS_KEY, {}))


BALANCED = ("load", "loadgroup")  # the --dist modes whose scheduling this run takes over: both balance the load


def check_scope(nodeid: str) -> str:
    """The unit of work a test belongs to: a parity item (``…[check]``) and the kill items (``…[ablation->check]``)
    of every check of its path share the path's (``decode``); any other test is a unit of its own. A check id is
    dotted (``path.case.kind``); a parameter id without a dot names no check."""
    _, bracket, param = nodeid.partition("[")
    check = param.removesuffix("]").rpartition("->")[2]
    return check.partition(".")[0] if bracket and "." in check else nodeid


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """The scheduler of a balanced split run: xdist's scope scheduling, with a check as the scope. (Its own
    ``xdist_group`` marks rename node ids, which pytest 9.2's node ids no longer allow.)"""
    if getattr(config.option, "dist", "no") not in BALANCED:
        return None
    from xdist.scheduler import LoadScopeScheduling

    class CheckScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return check_scope(nodeid)

    return CheckScheduling(config, log)
