"""The fastpath-parity pytest plugin: thin hooks that hand each concern to the module that owns it.

Options and markers (harness.options), inputs checked before collection (harness.validation), the parity session
that runs checks and records outcomes (harness.session), conformance runs (harness.plugins.conformance_run), the
given inputs and what consumed them (harness.given_inputs), ranks and devices (harness.placement), stopping on a
signal (harness.process.lifecycle), and the end of the run (harness.summary). Loaded by the repo's conftest.py and
exposed as a ``pytest11`` entry point, so an installed harness brings it to any pytest run.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import pytest
import torch

from harness import given_inputs, invocation, options, placement, session, summary, validation, workers
from harness.inputs import checkpoints, host
from harness.judging import catalogue, checks
from harness.judging.items import keep_parity_item
from harness.plugins import conformance, conformance_run
from harness.process import launch, lifecycle, progress_lines
from harness.reports import bench
from harness.reports.listing import parity_list

PROGRESS_KEY = pytest.StashKey[Any]()  # the progress writer and load plan before this run (a nested run restores)
SIGNALS_KEY = pytest.StashKey[Any]()  # puts back the signal handlers this run replaced (harness.process.lifecycle)


def pytest_addoption(parser: pytest.Parser) -> None:
    options.add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    invocation.rerun_with_project_config(config)  # first: a run configured from elsewhere starts again as typed
    workers.refuse_unsplittable(config)
    for name, text in options.MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    conformance_run.apply_impls(config)
    detected = validation.validate_inputs(config)
    parity = session.ParitySession(config)
    parity.checkpoints = detected
    config.stash[session.SESSION_KEY] = parity
    config.stash[PROGRESS_KEY] = progress_lines.saved()
    progress_lines.set_writer(_past_capture(config))
    config.stash[SIGNALS_KEY] = lifecycle.install()
    config.pluginmanager.register(summary.InterruptTraceback(config), "fastpath-parity-interrupt")
    # the gpu tier's model loads, one per checkpoint holding a model and dtype: each says which it is, on stderr
    progress_lines.plan_loads([(str(c.path), str(dtype)) for c in detected if c.source in validation.LOADABLE
                               for dtype in options.parse_dtypes(config.getoption("dtype"))])
    placement.configure_placement(config)
    workers.wait_passively(config)


def _past_capture(config: pytest.Config) -> Any:
    """A progress-line writer that steps past pytest's output capture, which would hold the line until the item
    ends; only for the moment of the write (a model load or a rendezvous blocks the item meanwhile)."""

    def write(line: str) -> None:
        capture = config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

    return write


def pytest_report_header(config: pytest.Config) -> list[str]:
    return conformance_run.header_lines(config)


def pytest_cmdline_main(config: pytest.Config) -> int | None:
    """``--parity-list [PATTERN]``: print the catalogue and exit 0, like ``--fixtures`` and ``--markers``."""
    pattern = config.getoption("parity_list", None)
    if pattern is None:
        return None
    try:
        catalogue.load()
    except ImportError as err:  # the catalogue modules live in the suite's checkout, not the installed package
        print(f"--parity-list: the check catalogue cannot be imported from {os.getcwd()} ({err}); run it from the "
              "suite's checkout (its parity/, mutation/ and gpu/ modules must be importable)")
        return int(pytest.ExitCode.USAGE_ERROR)
    lines = parity_list(pattern)
    for line in lines:
        print(line)
    if not lines:
        print(f"no check id matches {pattern!r}")
    return 0


def pytest_itemcollected(item: pytest.Item) -> None:
    keep_parity_item(item)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    conformance_run.conformance_items(config, items)
    reason = options.gpu_skip_reason(config)
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_deselected(items: list[pytest.Item]) -> None:
    for item in items:
        given_inputs.run_ledger(item.config).deselect(item.nodeid, given_inputs.item_inputs(item.config, item),
                                                      conformance_run.deselected_why(item))


def pytest_collection_finish(session: pytest.Session) -> None:
    given_inputs.watch_items(session)
    host.freeze_what_collection_built()


def pytest_runtest_setup(item: pytest.Item) -> None:
    lifecycle.raise_if_requested()  # a stop whose own raise was lost (harness.process.lifecycle) starts no item


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    rep = yield
    return session.settle_report(item, call, rep)


@pytest.fixture(scope="session")
def parity_session(request: pytest.FixtureRequest) -> session.ParitySession:
    """The run's parity session: runs checks and ablations and records them for the report."""
    return request.config.stash[session.SESSION_KEY]


@pytest.fixture(scope="session")
def parity_ctx(parity_session: session.ParitySession) -> checks.CheckContext:
    """The CPU tier's context: fp32 on the CPU, gloo worlds shared across checks."""
    return parity_session.context()


@pytest.fixture(scope="session")
def bench_log(parity_session: session.ParitySession) -> bench.BenchLog:
    """Where bench items record what they measured: the run's tables and the report's ``benchmarks``."""
    return parity_session.benchmarks


@pytest.fixture(scope="session")
def gpu_dtypes(request: pytest.FixtureRequest) -> list[torch.dtype]:
    return options.parse_dtypes(request.config.getoption("dtype"))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist: a check and its kill items go to one worker (harness.workers)."""
    return workers.make_scheduler(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """pytest-xdist: a worker ended; its records join the run's (harness.workers)."""
    workers.merge(node.config, node)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    summary.finish(session)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    summary.write_summary(terminalreporter, config)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    parity = config.stash.get(session.SESSION_KEY, None)
    if parity is not None:
        parity.close()
    if config.stash.get(conformance_run.IMPLS_KEY, None):
        conformance.clear()
    checkpoints.trust_remote_code(False)
    launch.set_fault_bound(None)
    progress_lines.restore(config.stash.get(PROGRESS_KEY, ([], {}, [])))
    # a torchrun rank asked to stop may have a task thread inside a collective its peers never finish
    given_up = launch.lost() or (launch.joined() is not None and lifecycle.requested())
    config.stash.get(SIGNALS_KEY, lambda: None)()
    placement.release_placement()
    if given_up:
        # a step of the launcher's group never finished on some rank: a thread still sits in its collective,
        # and tearing the group down at interpreter exit would wait on it until the transport's own timeout
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(parity.exitstatus if parity is not None else int(pytest.ExitCode.INTERNAL_ERROR))
