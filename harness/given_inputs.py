"""The inputs a run was given (--checkpoint, --capture-dir, --impl), which items consume each, and those no check
ran on: a run handed an input and judging nothing on it fails, naming it (harness.inputs.ledger keeps the books)."""

from __future__ import annotations

import contextlib
import json

import pytest

from harness.inputs.ledger import InputLedger
from harness.judging import checks
from harness.judging.items import parity_item
from harness.paths import path_of
from harness.plugins import conformance
from harness.plugins.conformance_run import IMPLS_KEY
from harness.process import launch
from harness.session import SESSION_KEY, first_line

__all__ = ["IDLE_KEY", "INPUTS_KEY", "ItemEnds", "given_inputs", "idle_inputs", "item_inputs", "run_ledger",
           "watch_items"]

INPUTS_KEY = pytest.StashKey[InputLedger]()  # the run's --checkpoint/--capture-dir/--impl and their items' ends
IDLE_KEY = pytest.StashKey[list[str]]()  # one line per given input that no check ran on


def given_inputs(config: pytest.Config) -> tuple[str, ...]:
    """The run's inputs a check judges, as labels naming the option and its value (``--checkpoint=/m/x``)."""
    labels = [f"--checkpoint={given}" for given in config.getoption("checkpoint") or []]
    capture = config.getoption("capture_dir")
    if capture is not None:
        labels.append(f"--capture-dir={capture}")
    labels += [f"--impl {path}={spec}" for path, spec in (config.stash.get(IMPLS_KEY, None) or {}).items()]
    return tuple(labels)


def item_inputs(config: pytest.Config, item: pytest.Item) -> list[str]:
    """The inputs a parity item judges: the gpu checkpoint it loads, the capture directory its check declares it
    reads, the implementation under test of its path (its checks, not the suite's ablations, which skip)."""
    found = parity_item(item)
    if found is None:
        return []
    used = []
    session = config.stash.get(SESSION_KEY, None)
    detected = session.checkpoints if session is not None else []
    for given, checkpoint in zip(config.getoption("checkpoint") or [], detected, strict=False):
        if found.checkpoint is not None and found.checkpoint == str(checkpoint.path):
            used.append(f"--checkpoint={given}")
    capture = config.getoption("capture_dir")
    if capture is not None and checks.exists(found.check) and "capture_dir" in checks.get(found.check).reads:
        used.append(f"--capture-dir={capture}")
    impls = config.stash.get(IMPLS_KEY, None) or {}
    if impls and not found.ablation and any(key.partition(".")[0] == path_of(found.check) for key in impls):
        path = path_of(found.check)
        # the implementation that drives it (per family or path-wide); one it cannot call counts against the
        # path-wide one, so a run where nothing could call it says why
        key = conformance.judgement(found.check).key or path
        if key in impls:
            used.append(f"--impl {key}={impls[key]}")
    return used


def run_ledger(config: pytest.Config) -> InputLedger:
    ledger = config.stash.get(INPUTS_KEY, None)
    if ledger is None:
        ledger = config.stash[INPUTS_KEY] = InputLedger(given_inputs(config))
    return ledger


class ItemEnds:
    """Files each phase report of an item that consumes an input in the run's ledger (registered per run)."""

    def __init__(self, ledger: InputLedger):
        self.ledger = ledger

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped:
            text = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            reason = f"xfail: {report.wasxfail}" if hasattr(report, "wasxfail") else text.removeprefix("Skipped: ")
        else:
            reason = report.longreprtext.strip().splitlines()[-1] if report.failed and report.longrepr else ""
        self.ledger.report(report.nodeid, report.when, report.outcome, first_line(reason))


def watch_items(session: pytest.Session) -> None:
    """Expect each collected item's inputs and file every phase report of them in the run's ledger."""
    ledger = run_ledger(session.config)
    if not ledger.inputs:
        return
    for item in session.items:
        ledger.expect(item.nodeid, item_inputs(session.config, item))
    session.config.pluginmanager.register(ItemEnds(ledger), name=f"fastpath-parity-inputs-{id(ledger)}")


def idle_inputs(config: pytest.Config) -> list[str]:
    """One line per given input that no check ran on (every item on it skipped, deselected or never collected).

    A run that only lists or plans items (--collect-only, --setup-only, --setup-plan) is meant to run none. Under
    torchrun the ranks exchange their lines on the launcher's board, so every rank fails alike.
    """
    option = config.option
    if getattr(option, "collectonly", False) or getattr(option, "setuponly", False) or \
            getattr(option, "setupplan", False):
        return []
    ledger = run_ledger(config)
    if not ledger.inputs:
        return []
    return list(_agreed(ledger.idle()).values())


def _agreed(idle: dict[str, str]) -> dict[str, str]:
    """The idle inputs of every rank (the lowest rank's line per input): one rank that ran nothing on an input
    fails them all. Outside torchrun, or when the board cannot be read, this rank's own."""
    if launch.joined() is None:
        return idle
    try:
        statuses = launch.agree("ok", json.dumps(idle), phase="the session's idle inputs")
    except Exception:  # noqa: BLE001 - a lost peer already failed the run; keep this rank's own verdict
        return idle
    merged: dict[str, str] = {}
    for status, text, _ in statuses:
        if status == "ok":
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                merged.update({k: v for k, v in json.loads(text).items() if k not in merged})
    return {**merged, **{k: v for k, v in idle.items() if k not in merged}}
