"""The fastpath-parity pytest plugin: options, markers, the session that runs checks, the report.

Loaded by the repo's conftest.py and exposed as a ``pytest11`` entry point, so an installed
harness brings it to any pytest run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from harness import ablation as ablation_mod
from harness import (
    bench,
    catalogue,
    checkpoints,
    checks,
    compat,
    conformance,
    floors,
    host,
    launch,
    lifecycle,
    progress_lines,
    report,
)
from harness import device_map as device_maps
from harness.ablation import KillResult
from harness.checks import CheckContext
from harness.compare import Verdict
from harness.dist import WorldTaskError, stable_error
from harness.inputs import InputLedger
from harness.items import ParityItem
from harness.paths import path_of
from harness.registry import split_ref
from harness.report import Unfinished

MARKERS = {
    "cpu": "CPU tier: fake kernels and tiny random-init models, every parity check and ablation",
    "gpu": "GPU tier: real checkpoints (needs CUDA and --checkpoint)",
    "bench": "pytest-benchmark measurements of a fast path against its stock path",
    "launch": "the launchers on the CPU: spawned ranks, torchrun, the gpu tier's dry run (scripts/test-all runs them)",
    "browser": "the HTML report rendered in headless Chromium (scripts/test-all runs it; skipped without it)",
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SESSION_KEY = pytest.StashKey["ParitySession"]()
IMPLS_KEY = pytest.StashKey[dict[str, str]]()
NOT_JUDGED_KEY = pytest.StashKey[dict[str, str]]()  # conformance mode: deselected check id -> why it cannot judge
OWN_TESTS_KEY = pytest.StashKey[dict[str, int]]()  # conformance mode: path -> its deselected non-check tests
PARITY_ITEM_KEY = pytest.StashKey[ParityItem]()  # what a generated item runs (harness.items)
PROGRESS_KEY = pytest.StashKey[Any]()  # the progress writer and load plan before this run (a nested run restores)
SIGNALS_KEY = pytest.StashKey[Any]()  # puts back the signal handlers this run replaced (harness.lifecycle)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fastpath-parity")
    group.addoption("--parity-report", action="append", default=None, metavar="PATH",
                    help="write the parity report to PATH (.md, .json or .html); repeatable")
    group.addoption("--checkpoint", action="append", default=None, metavar="PATH",
                    help="a real checkpoint directory for the gpu tier; repeatable")
    group.addoption("--dtype", default="fp32,bf16", metavar="LIST",
                    help="gpu-tier dtypes: fp32, bf16, or both (comma-separated, or 'both'); default fp32,bf16")
    group.addoption("--device", default="auto", choices=("auto", "cpu", "cuda"),
                    help="gpu-tier device: auto (cuda when available), cpu (dry run of the gpu tier), cuda")
    group.addoption("--trust-remote-code", action="store_true", default=False,
                    help="allow loading checkpoints whose config.json has an auto_map: their own Python files run "
                         "(HunyuanImage-3 needs it). Off by default, as in transformers; the report records what ran")
    group.addoption("--capture-dir", default=None, metavar="DIR",
                    help="attention captures (call0_rank0.npz style) to run the attention checks on "
                         "(pytest's own --capture is taken)")
    group.addoption("--impl", action="append", default=None, metavar="PATH=MODULE:CALLABLE",
                    help="run PATH's checks against your own implementation (conformance mode); repeatable. "
                         "Signatures: " + "; ".join(f"{p}: {sig}" for p, sig in conformance.SIGNATURES.items()))
    group.addoption("--parity-list", nargs="?", const="*", default=None, metavar="PATTERN",
                    help="list the checks (id, module:qualname, tier, policy, killers) whose id matches the "
                         "fnmatch PATTERN (default: all), then exit without running tests")
    _add_placement_options(group)


def _add_placement_options(group: Any) -> None:
    group.addoption("--device-map", default=None, metavar="MAP",
                    help="place gpu-tier models with accelerate across the visible GPUs: balanced, auto, sequential, "
                         "or a JSON max-memory split like '{\"0\": \"70GiB\", \"1\": \"70GiB\"}'; default: one "
                         "device where the weights fit, else balanced")
    group.addoption("--fault-bound", default=None, metavar="SECONDS",
                    help="under torchrun, every rank raises within SECONDS of any rank raising, stopping or dying "
                         f"(default ${launch.FAULT_BOUND_ENV} or {launch.DEFAULT_FAULT_BOUND_S:g})")


def parse_dtypes(text: str) -> list[torch.dtype]:
    names = ["fp32", "bf16"] if text.strip() == "both" else [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in DTYPES]
    if unknown or not names:
        raise pytest.UsageError(f"--dtype {text!r}: expected fp32, bf16, fp16, 'both' or a comma list; "
                                f"unknown {unknown}")
    return [DTYPES[n] for n in names]


def skip_unavailable_path(check_id: str) -> None:
    """Skip, here in the parent before any world starts, a check whose path this stack cannot build."""
    reason = compat.path_unavailable(checks.get(check_id).path)
    if reason:
        pytest.skip(reason)


class ParitySession:
    """Runs checks and ablations for a pytest session and keeps what they said for the report."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.verdicts: dict[str, Verdict] = {}
        self.kills: list[KillResult] = []
        self._contexts: dict[tuple[Any, ...], CheckContext] = {}
        self._pools: dict[str, Any] = {}
        self.capture_dir: str | None = config.getoption("capture_dir")
        self.checkpoints: list[checkpoints.Checkpoint] = []
        self.conformance_problems: list[str] = []
        self.unfinished: dict[str, Unfinished] = {}  # check label -> why it gave no verdict
        self.pairs_unfinished: dict[tuple[str, str], Unfinished] = {}  # (ablation, check label) -> why not run
        self.report_data: dict[str, Any] | None = None
        self.written: list[str] = []
        self.write_errors: list[str] = []
        self.exitstatus: int = 0
        self.benchmarks = bench.BenchLog()  # what the run's bench items measured

    def context(self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                checkpoint: str | None = None) -> CheckContext:
        device = torch.device(device)
        key = (device.type, dtype, checkpoint)
        if key not in self._contexts:
            from harness.dist import WorldPool

            pool = self._pools.setdefault(device.type, WorldPool(device=device))
            self._contexts[key] = CheckContext(device=device, dtype=dtype, checkpoint=checkpoint,
                                               capture_dir=self.capture_dir, worlds=pool)
        return self._contexts[key]

    def check(self, check_id: str, ctx: CheckContext | None = None, label: str | None = None) -> Verdict:
        """Run a check once per label (cached: the kill matrix reuses the baseline).

        A check that raises, times out or skips is recorded as such before the exception goes on; one that
        raised is not run again in this session (its later callers get CheckFailedEarlier).
        """
        key = label or check_id
        earlier = self.unfinished.get(key)
        if key not in self.verdicts and earlier is not None and earlier.status == "failed":
            raise CheckFailedEarlier(f"{key} already failed in this session: {earlier.error_type}: {earlier.reason}")
        try:
            skip_unavailable_path(check_id)
            if key not in self.verdicts:
                watch = ImplementationWatch(checks.get(check_id).path)
                verdict = watch.require_ran(checks.run_check(check_id, ctx or self.context()))
                self.verdicts[key] = dataclasses.replace(verdict, check_id=key) if label else verdict
        except OUTCOME_ERRORS as err:
            self.unfinished[key] = unfinished(key, err)
            raise
        self.unfinished.pop(key, None)
        return self.verdicts[key]

    def kill(self, ablation_name: str, check_id: str, ctx: CheckContext | None = None,
             label: str | None = None) -> KillResult:
        """Run ``check_id`` under the ablation; ``label`` names the check in the report (gpu: checkpoint, dtype)."""
        try:
            skip_unavailable_path(check_id)
            result = ablation_mod.run_under(ablation_mod.get(ablation_name), check_id, ctx or self.context())
        except OUTCOME_ERRORS as err:
            self.pairs_unfinished[(ablation_name, label or check_id)] = unfinished(label or check_id, err,
                                                                                  ablation_name)
            raise
        if label:
            result = dataclasses.replace(result, check=label)
        self.kills.append(result)
        return result

    def record_item(self, check_label: str, ablation_name: str, outcome: Unfinished, override: bool = False) -> None:
        """A parity item failed or skipped: record the item's reason where its check (or pair) recorded none.

        ``override``: the item failed on another rank (torchrun), so what this rank recorded must not stand.
        """
        if ablation_name:
            pair = (ablation_name, check_label)
            recorded = [k for k in self.kills if (k.ablation, k.check) == pair]
            if override:
                self.kills = [k for k in self.kills if (k.ablation, k.check) != pair]
            elif recorded or pair in self.pairs_unfinished:
                return
            self.pairs_unfinished[pair] = dataclasses.replace(outcome, ablation=ablation_name)
            return
        if override:
            self.verdicts.pop(check_label, None)
        elif check_label in self.verdicts or check_label in self.unfinished:
            return
        self.unfinished[check_label] = outcome

    def report(self) -> dict[str, Any]:
        order = {c.id: i for i, c in enumerate(checks.all_checks())}

        def rank(key: str) -> tuple[int, str]:
            return order.get(key.split("[", 1)[0], len(order)), key

        rows: dict[str, Verdict | Unfinished] = {**self.unfinished, **self.verdicts}
        kills: list[KillResult | Unfinished] = [*self.kills, *(self.pairs_unfinished[p] for p in
                                                               sorted(self.pairs_unfinished))]
        remote = ({"trusted": True, "ran": checkpoints.remote_code_ran()}
                  if self.config.getoption("trust_remote_code") else None)
        data = report.build([rows[k] for k in sorted(rows, key=rank)], kills, implementations=conformance.specs(),
                            remote_code=remote, host=host.fingerprint(),
                            benchmarks=self.benchmarks.to_json() if self.benchmarks else None)
        not_judged = self.config.stash.get(NOT_JUDGED_KEY, {})
        if not_judged:  # conformance mode: the checks deselected because they cannot call the user's code
            data["not_judged"] = dict(sorted(not_judged.items()))
        return data

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


class CheckFailedEarlier(RuntimeError):
    """A check that already raised in this session is asked for again (a kill item's baseline, say)."""


# what a check may end with besides a verdict: any error, pytest's skip and fail outcomes
OUTCOME_ERRORS = (Exception, pytest.skip.Exception, pytest.fail.Exception)


def _first_line(text: str, limit: int = 400) -> str:
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    return stable_error(line)[:limit]


CAUSES = ("raised", "stuck", "died", "hung")  # a rank's own failure; "blocked" only waited for one of these


def unfinished(check_label: str, err: BaseException, ablation_name: str = "") -> Unfinished:
    """How a check (or pair) ended without a verdict: skipped with its reason, or failed with type, message, ranks."""
    if isinstance(err, pytest.skip.Exception):
        return Unfinished(check_label, "skipped", _first_line(str(err.msg or "")), ablation=ablation_name)
    message = _first_line(str(err))
    ranks: tuple[int, ...] = ()
    if isinstance(err, WorldTaskError):
        # the ranks that caused it, not those that only waited for them (blocked) or this rank answering for them
        bad = [o for o in err.outcomes if o.status != "ok"]
        culprits = [o for o in bad if o.status in CAUSES] or bad
        ranks = tuple(o.rank for o in culprits)
        if culprits:
            message = f"{message}: {_first_line(culprits[0].line())}"
    elif launch.joined() is not None:
        ranks = (launch.joined().rank,)
    return Unfinished(check_label, "failed", message, type(err).__name__, ranks, ablation_name)


class ImplementationWatch:
    """How often one check called the implementation under test for its path (conformance mode only).

    The calls are counted by ``conformance.resolve``'s wrapper, in this process and inside every rank of a
    world (each task brings its rank's count back), so a check whose work runs in ranks is seen too.
    """

    def __init__(self, path: str):
        self.path = path
        self.spec = conformance.active(path)
        self.calls_before = conformance.calls(path)

    @property
    def calls(self) -> int:
        return conformance.calls(self.path) - self.calls_before

    def require_ran(self, verdict: Verdict) -> Verdict:
        """Under ``--impl`` a check judges the user's implementation only if it called it: no silent fallback.

        A check that cannot call it is declared with ``conformance.not_judged`` and never reaches here (it
        is deselected); any other check that did not call it fails, whatever its numbers say.
        """
        if self.spec is None:
            return verdict
        calls = self.calls
        return verdict.require(calls > 0, f"the implementation under test ({self.spec}) ran in this check",
                               impl_calls=calls)


def never_ran(config: pytest.Config, judged_paths: set[str]) -> list[str]:
    """Paths under test whose checks ran while the user's implementation was never called in this process."""
    return [f"--impl {path}={spec}: no {path} check called the implementation under test"
            for path, spec in (config.stash.get(IMPLS_KEY, None) or {}).items()
            if path in judged_paths and conformance.calls(path) == 0]


def parse_impls(given: list[str] | None) -> dict[str, str]:
    """``["attention=mod:attend", ...]`` -> {path: spec}; a malformed or unusable spec is a usage error naming it."""
    found: dict[str, str] = {}
    for text in given or []:
        path, sep, spec = text.partition("=")
        if not sep or not path or not spec:
            raise pytest.UsageError(f"--impl {text!r}: expected PATH=MODULE:CALLABLE with PATH one of "
                                    f"{', '.join(conformance.PATHS)} (e.g. --impl attention=my_kernels:attend)")
        if path in found:
            raise pytest.UsageError(f"--impl {text!r}: path {path!r} is already under test ({found[path]})")
        found[path] = spec
    return found


def apply_impls(config: pytest.Config) -> None:
    """Put each ``--impl`` under test now, so a typo stops the run before any check."""
    found = parse_impls(config.getoption("impl"))
    for path, spec in found.items():
        try:
            conformance.use(path, spec)
        except ValueError as err:
            conformance.clear()
            raise pytest.UsageError(f"--impl {path}={spec}: {err}") from None
    config.stash[IMPLS_KEY] = found


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [f"conformance mode: {path} checks judge {spec} ({conformance.SIGNATURES[path]}); other paths deselected"
            for path, spec in (config.stash.get(IMPLS_KEY, None) or {}).items()]


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


def parity_list(pattern: str = "*") -> list[str]:
    """One line per check whose id matches ``pattern``: id, module:qualname, tier, policy, killers."""
    killers: dict[str, list[str]] = {}
    for item in ablation_mod.all_ablations():
        for check_id in item.kills:
            killers.setdefault(check_id, []).append(f"{item.name} ({item.mode_for(check_id)})")
    lines = []
    for check in sorted(checks.all_checks(), key=lambda c: c.id):
        if not fnmatch.fnmatchcase(check.id, pattern):
            continue
        policy = check.policy  # a check that declares its policy up front (at registration) shows it here
        fields = [check.id, check.where or "?", f"tier={check.tier}"]
        bound = _bound_arguments(check.fn)
        if bound:
            fields.append(f"args={bound}")
        if policy:
            fields.append(f"policy={policy}")
        stated = floors.stated_for(check.id)
        if stated:
            fields.append(f"floor={stated}")
        fields.append("killers=" + (", ".join(sorted(killers.get(check.id, []))) or "none"))
        fields.append(conformance_mark(check))
        lines.append("  ".join(fields))
    return lines


def conformance_mark(check: checks.Check) -> str:
    """Whether ``pytest -m cpu --impl PATH=...`` judges the user's implementation with this check, and if not, why."""
    if check.path not in conformance.PATHS:
        return "impl=none (no --impl path)"
    if check.tier != "cpu":
        return "impl=no (gpu tier; a conformance run is -m cpu)"
    reason = conformance.judged_by(check.id)
    if reason is not None:
        return f"impl=not judged ({reason})"
    scope = conformance.layout_scope(check.id)  # a check of one layout judges the implementations declaring it
    if scope is None:
        return "impl=judged"
    attribute = conformance.LAYOUTS[scope[0]][0]
    return f"impl=judged ({attribute} = {scope[1]!r} implementations)"


def _bound_arguments(fn: Any) -> str:
    """What a ``functools.partial`` check binds (one function computes several ids), as call arguments."""
    if not isinstance(fn, functools.partial):
        return ""
    def short(value: Any) -> str:  # a case object shows by its name, not its whole repr
        name = getattr(value, "name", None)
        return f"{type(value).__name__}({name!r})" if isinstance(name, str) and not isinstance(value, str) \
            else repr(value)

    shown = [short(a) for a in fn.args] + [f"{k}={short(v)}" for k, v in fn.keywords.items()]
    return ", ".join(shown)


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    apply_impls(config)
    detected = validate_inputs(config)
    session = ParitySession(config)
    session.checkpoints = detected
    config.stash[SESSION_KEY] = session
    config.stash[PROGRESS_KEY] = progress_lines.saved()
    progress_lines.set_writer(_past_capture(config))
    config.stash[SIGNALS_KEY] = lifecycle.install()
    # the gpu tier's model loads, one per checkpoint holding a model and dtype: each says which it is, on stderr
    progress_lines.plan_loads([(str(c.path), str(dtype)) for c in detected if c.source in LOADABLE
                               for dtype in parse_dtypes(config.getoption("dtype"))])
    _configure_placement(config)


LOADABLE = ("diffusers", "transformers", "remote_code")  # checkpoint sources load_model builds a model from


def _past_capture(config: pytest.Config) -> Any:
    """A progress-line writer that steps past pytest's output capture, which would hold the line until the item
    ends; only for the moment of the write (a model load or a rendezvous blocks the item meanwhile)."""

    def write(line: str) -> None:
        capture = config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

    return write


def validate_inputs(config: pytest.Config) -> list[checkpoints.Checkpoint]:
    """Every file and option the run reads, checked now: any malformed one is a usage error naming it.

    Checkpoints are detected (their config.json may hold anything), remote code is refused without
    --trust-remote-code, capture files are read, and each --parity-report path is opened for writing,
    all before collection, so nothing fails after the checks ran.
    """
    trusted = bool(config.getoption("trust_remote_code"))
    checkpoints.trust_remote_code(trusted)
    detected = []
    for path in config.getoption("checkpoint") or []:
        try:
            found = checkpoints.detect(path)
            checkpoints.require_trust(found, trusted)
        except checkpoints.CheckpointError as err:
            raise pytest.UsageError(f"--checkpoint: {err}") from None
        if found.feeds == "attention":
            _validate_captures(f"--checkpoint {path}", found.path)
        detected.append(found)
    parse_dtypes(config.getoption("dtype"))
    capture = config.getoption("capture_dir")
    if capture is not None:
        if not Path(capture).is_dir():
            from harness.attention.capture import not_a_file

            raise pytest.UsageError(f"--capture-dir {not_a_file(Path(capture), 'a directory of capture files')}")
        _validate_captures(f"--capture-dir {capture}", Path(capture))
    if _writes_reports():
        for path in config.getoption("parity_report") or []:
            try:
                report.prepare(path)
            except ValueError as err:
                raise pytest.UsageError(str(err)) from None
    try:
        launch.set_fault_bound(config.getoption("fault_bound"))
        launch.fault_bound()  # the environment's value is checked too
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None
    return detected


def _validate_captures(option: str, directory: Path) -> None:
    from harness.attention import capture

    try:
        capture.validate_directory(directory)
    except ValueError as err:
        raise pytest.UsageError(f"{option}: {err}") from None


def _writes_reports() -> bool:
    """Under torchrun only rank 0 writes the report, so only rank 0 checks where it goes."""
    try:
        launched = launch.launched()
    except ValueError:
        return True  # the launch environment's own error is reported by _configure_placement
    return launched is None or launched.rank == 0


def _configure_placement(config: pytest.Config) -> None:
    """Where ranks and models go: PARITY_START_METHOD, --device-map, and the torchrun group when launched."""
    from harness.dist import resolve_start_method

    device = gpu_device(config)
    try:
        resolve_start_method(device.type)
        text = config.getoption("device_map")
        requested = device_maps.parse(text) if text is not None else None
        if requested is not None:  # a split naming GPUs this machine lacks cannot be honoured by any load
            device_maps.check_visible(requested)
        device_maps.configure(requested, device.type)
        if launch.launched() is not None:
            lifecycle.die_with_parent()  # a rank of torchrun's never outlives the launcher
            launch.join(device.type)
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None


def reporting_rank() -> bool:
    """Under torchrun only rank 0 prints the table and writes the report; every rank does otherwise."""
    joined = launch.joined()
    return joined is None or joined.rank == 0


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
    path = path_of(found.check)
    spec = (config.stash.get(IMPLS_KEY, None) or {}).get(path)
    if spec is not None and not found.ablation:
        used.append(f"--impl {path}={spec}")
    return used


def _ledger(config: pytest.Config) -> InputLedger:
    ledger = config.stash.get(INPUTS_KEY, None)
    if ledger is None:
        ledger = config.stash[INPUTS_KEY] = InputLedger(given_inputs(config))
    return ledger


def _deselected_why(item: pytest.Item) -> str:
    check_id, _ = item_check(item)
    under_test = item.config.stash.get(IMPLS_KEY, None) or {}
    if under_test and path_of(str(check_id)) not in under_test:
        return f"conformance mode runs only the {', '.join(sorted(under_test))} checks"
    reason = item.config.stash.get(NOT_JUDGED_KEY, {}).get(str(check_id))
    if under_test and reason:
        return f"cannot call the implementation under test: {reason}"
    return "by this run's -m/-k/--deselect"


def pytest_deselected(items: list[pytest.Item]) -> None:
    for item in items:
        _ledger(item.config).deselect(item.nodeid, item_inputs(item.config, item), _deselected_why(item))


class _ItemEnds:
    """Files each phase report of an item that consumes an input in the run's ledger (registered per run)."""

    def __init__(self, ledger: InputLedger):
        self.ledger = ledger

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped:
            text = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            reason = f"xfail: {report.wasxfail}" if hasattr(report, "wasxfail") else text.removeprefix("Skipped: ")
        else:
            reason = report.longreprtext.strip().splitlines()[-1] if report.failed and report.longrepr else ""
        self.ledger.report(report.nodeid, report.when, report.outcome, _first_line(reason))


def pytest_collection_finish(session: pytest.Session) -> None:
    ledger = _ledger(session.config)
    if not ledger.inputs:
        return
    for item in session.items:
        ledger.expect(item.nodeid, item_inputs(session.config, item))
    session.config.pluginmanager.register(_ItemEnds(ledger), name=f"fastpath-parity-inputs-{id(ledger)}")


def idle_inputs(config: pytest.Config) -> list[str]:
    """One line per given input that no check ran on (every item on it skipped, deselected or never collected).

    A run that only lists or plans items (--collect-only, --setup-only, --setup-plan) is meant to run none. Under
    torchrun the ranks exchange their lines on the launcher's board, so every rank fails alike.
    """
    option = config.option
    if getattr(option, "collectonly", False) or getattr(option, "setuponly", False) or \
            getattr(option, "setupplan", False):
        return []
    ledger = _ledger(config)
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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    parity = session.config.stash.get(SESSION_KEY, None)
    if parity is None:
        return
    problems = never_ran(session.config, {v.path for v in parity.verdicts.values()})
    if problems:
        parity.conformance_problems = problems
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    # an input no check ran on judged nothing: exit 1 like a failed check, not 5 ("no tests collected"), which
    # lanes often tolerate, and items were collected; a run already failing keeps its own status
    idle = session.config.stash[IDLE_KEY] = idle_inputs(session.config)
    if idle and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if reporting_rank() and (parity.verdicts or parity.kills or parity.unfinished or parity.pairs_unfinished or idle
                             or parity.benchmarks):
        parity.report_data = parity.report()
        if idle:
            parity.report_data["nothing_ran"] = idle
        if session.exitstatus == pytest.ExitCode.INTERRUPTED:
            parity.report_data["interrupted"] = interrupted_line()
        for path in session.config.getoption("parity_report") or []:
            try:
                parity.written.append(os.fspath(report.write(parity.report_data, path)))
            except OSError as err:  # checked at configure; the disk may still fill up or go away
                parity.write_errors.append(f"--parity-report {path}: not written ({type(err).__name__}: "
                                           f"{err.strerror or err})")
        if parity.write_errors:
            session.exitstatus = pytest.ExitCode.INTERNAL_ERROR
    parity.exitstatus = int(session.exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    session = config.stash.get(SESSION_KEY, None)
    if session is not None:
        session.close()
    if config.stash.get(IMPLS_KEY, None):
        conformance.clear()
    checkpoints.trust_remote_code(False)
    launch.set_fault_bound(None)
    progress_lines.restore(config.stash.get(PROGRESS_KEY, ([], {}, [])))
    config.stash.get(SIGNALS_KEY, lambda: None)()
    # a torchrun rank asked to stop may have a task thread inside a collective its peers never finish
    given_up = launch.lost() or (launch.joined() is not None and lifecycle.requested())
    _release_placement()
    if given_up:
        # a step of the launcher's group never finished on some rank: a thread still sits in its collective,
        # and tearing the group down at interpreter exit would wait on it until the transport's own timeout
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(session.exitstatus if session is not None else int(pytest.ExitCode.INTERNAL_ERROR))


def interrupted_line() -> str:
    """What a report of an interrupted run says first: which signal stopped it, and that it covers only part."""
    asked = lifecycle.requested()
    how = "by Ctrl-C" if asked in ("", "SIGINT") else f"by {asked}"
    return (f"INTERRUPTED {how}: the run stopped before every item ran; this report holds only what finished, and "
            "the run is not green")


def _release_placement() -> None:
    """Leave the torchrun group and forget --device-map (an in-process pytester run must not inherit either)."""
    launch.leave()
    device_maps.configure(None, "")


def gpu_device(config: pytest.Config) -> torch.device:
    choice = config.getoption("device")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def gpu_skip_reason(config: pytest.Config) -> str | None:
    """Why the gpu tier cannot run here, or None when it can."""
    choice = config.getoption("device")
    if choice != "cpu" and not torch.cuda.is_available():
        return ("gpu tier needs CUDA: torch.cuda.is_available() is False on this machine "
                "(pass --device cpu for a dry run of the gpu tier on the CPU)")
    if not config.getoption("checkpoint"):
        return "gpu tier needs real weights: pass --checkpoint=PATH (repeatable) to run it"
    return None


_PATH_FILE = re.compile(r"^test_(" + "|".join(conformance.PATHS) + r")[_.]")


def pytest_itemcollected(item: pytest.Item) -> None:
    """Keep the ``ParityItem`` a generated item was parametrized with (found by its type) in the item's stash."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    found = [value for value in params.values() if isinstance(value, ParityItem)]
    if len(found) > 1:
        raise pytest.UsageError(f"{item.nodeid}: parametrized with {len(found)} parity items; one item runs one")
    if found:
        item.stash[PARITY_ITEM_KEY] = found[0]


def parity_item(item: pytest.Item) -> ParityItem | None:
    """What a generated item runs, or None for any other test."""
    return item.stash.get(PARITY_ITEM_KEY, None)


def item_check(item: pytest.Item) -> tuple[str | None, bool]:
    """(the check id a generated item runs, whether it runs it under an ablation); (None, False) otherwise."""
    found = parity_item(item)
    return (found.check, bool(found.ablation)) if found is not None else (None, False)


def item_path(item: pytest.Item) -> str | None:
    """The path an item tests: its check id's, else its folder's (tests/<path>/) or its module's name
    (test_<path>_*.py); None for machinery."""
    check_id, _ = item_check(item)
    if check_id is not None:
        return path_of(str(check_id))
    file = Path(str(item.path))
    if file.parent.name in conformance.PATHS:
        return file.parent.name
    found = _PATH_FILE.match(file.name)
    return found.group(1) if found else None


def conformance_items(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Conformance mode: keep only the checks of the paths under test, deselect those that cannot call the user's
    implementation (kept, with their reasons, for the summary) and the paths' other tests (property and fault
    tests of the suite's own implementation, counted for the summary), and skip the suite's own ablations."""
    under_test = config.stash.get(IMPLS_KEY, None)
    if not under_test:
        return
    kept, dropped = [], []
    not_judged: dict[str, str] = {}
    own_tests: dict[str, int] = {}
    for item in items:
        path = item_path(item)
        check_id, ablated = item_check(item)
        if path in under_test and check_id is None:
            own_tests[path] = own_tests.get(path, 0) + 1
        reason = conformance.judged_by(str(check_id)) if path in under_test and check_id is not None else None
        if path not in under_test or check_id is None or (reason is not None and not ablated):
            dropped.append(item)
            if reason is not None:
                not_judged[str(check_id)] = reason
            continue
        kept.append(item)
        if ablated:
            spec = under_test[path]
            module = split_ref(spec)[0]
            item.add_marker(pytest.mark.skip(reason=f"the suite's ablations patch the suite's seams, not {spec}; "
                                                    f"measure teeth with scripts/mutation-score --module {module}"))
    config.stash[NOT_JUDGED_KEY] = not_judged
    config.stash[OWN_TESTS_KEY] = own_tests
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def not_judged_lines(not_judged: dict[str, str], own_tests: dict[str, int] | None = None) -> list[str]:
    """The summary of what a conformance run deselected: the checks that cannot call the implementation under
    test, one line per reason naming them; and per path, how many of its tests exercise the suite's own code."""
    lines = [f"not judged: {count} {path} tests of the suite's own implementation (property, fault and unit "
             "tests beside the catalogue, deselected: only the checks judge yours)"
             for path, count in sorted((own_tests or {}).items())]
    if not not_judged:
        return lines
    by_reason: dict[str, list[str]] = {}
    for check_id, reason in sorted(not_judged.items()):
        by_reason.setdefault(reason, []).append(check_id)
    lines.append(f"not judged: {len(not_judged)} checks cannot call the implementation under test (deselected, "
                 "not passed):")
    lines += [f"  {', '.join(ids)}: {reason}" for reason, ids in by_reason.items()]
    return lines


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    conformance_items(config, items)
    reason = gpu_skip_reason(config)
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def parity_session(request: pytest.FixtureRequest) -> ParitySession:
    """The run's parity session: runs checks and ablations and records them for the report."""
    return request.config.stash[SESSION_KEY]


@pytest.fixture(scope="session")
def parity_ctx(parity_session: ParitySession) -> CheckContext:
    """The CPU tier's context: fp32 on the CPU, gloo worlds shared across checks."""
    return parity_session.context()


@pytest.fixture(scope="session")
def bench_log(parity_session: ParitySession) -> bench.BenchLog:
    """Where bench items record what they measured: the run's tables and the report's ``benchmarks``."""
    return parity_session.benchmarks


@pytest.fixture(scope="session")
def gpu_dtypes(request: pytest.FixtureRequest) -> list[torch.dtype]:
    return parse_dtypes(request.config.getoption("dtype"))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
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
    for written in session.written:
        terminalreporter.write_line(f"parity report written to {written}")
    for problem in session.write_errors:
        terminalreporter.write_line(f"ERROR {problem}", red=True)
    _summarise_placement(terminalreporter)


def _summarise_placement(terminalreporter: Any) -> None:
    """Say how this run's ranks started and where device-mapped models went (the dry run's proof)."""
    joined = launch.joined()
    if joined is not None:
        terminalreporter.write_line(f"ranks: torchrun group of {joined.world_size} (this is rank {joined.rank})")
    for checkpoint, text, placed in device_maps.placements():
        devices = sorted(set(placed.values()))
        terminalreporter.write_line(f"device map {text}: {checkpoint} on {', '.join(devices)} "
                                    f"({len(placed)} placement entries)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Under torchrun every rank reports each phase alike: a failure on any rank fails it on every rank.

    Ranks agree phase by phase over the launcher's board (harness.launch), so no rank runs a call that
    another rank's failed or skipped setup did not reach (which would leave the ranks out of step); a rank
    that stopped or died is reported failed within the fault bound. Then a parity item that failed or
    skipped before its check gave a verdict is recorded for the report.
    """
    rep = yield
    joined = launch.joined()
    failed: list[tuple[int, str]] = []
    if joined is not None:
        detail = _item_error(call, rep)
        statuses = launch.agree(rep.outcome, detail, phase=f"{item.nodeid} {call.when}")
        failed = [(rank, text) for rank, (status, text, _) in enumerate(statuses)
                  if status not in ("passed", "skipped")]
        skipped = [(rank, text) for rank, (status, text, _) in enumerate(statuses) if status == "skipped"]
        if failed and not rep.failed:
            rep.outcome = "failed"
            rep.longrepr = (f"{item.nodeid} {call.when} failed on ranks {[r for r, _ in failed]} of "
                            f"{joined.world_size} (passed here, on rank {joined.rank}):\n"
                            + "\n".join(f"rank {r}: {text}" for r, text in failed))
        elif skipped and rep.passed and call.when == "setup":
            rep.outcome = "skipped"
            rep.longrepr = (str(item.path), item.location[1] or 0,
                            f"skipped on ranks {[r for r, _ in skipped]}: {skipped[0][1]}")
    _record_item(item, call, rep, failed)
    return rep


def _item_error(call: pytest.CallInfo[None], rep: pytest.TestReport) -> str:
    """What a rank tells the others of its item's failure or skip: the exception itself, not a traceback line."""
    if not (rep.failed or rep.skipped) or not rep.longrepr:
        return ""
    if rep.failed and call.excinfo is not None:
        return _first_line(f"{call.excinfo.typename}: {call.excinfo.value}")
    return rep.longreprtext.strip().splitlines()[-1][:400]


def failed_elsewhere(label: str, failed_ranks: list[tuple[int, str]], here: int | None) -> Unfinished:
    """An item that passed on this rank and failed on others: the first other rank's own error, and only the
    ranks where it failed (not this one)."""
    others = [(r, text) for r, text in failed_ranks if r != here] or failed_ranks
    return Unfinished(label, "failed", f"rank {others[0][0]}: {_first_line(others[0][1])}", "failed on another rank",
                      tuple(r for r, _ in others))


def _record_item(item: pytest.Item, call: pytest.CallInfo[None], rep: pytest.TestReport,
                 failed_ranks: list[tuple[int, str]]) -> None:
    """A parity item that failed or skipped without its check recording why: the report gets the item's reason."""
    if not (rep.failed or rep.skipped) or call.when == "teardown":
        return
    session = item.config.stash.get(SESSION_KEY, None)
    found = parity_item(item)
    if session is None or found is None:
        return
    label, ablation_name = found.report_label, found.ablation
    if rep.skipped:
        text = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        outcome = Unfinished(label, "skipped", _first_line(text.removeprefix("Skipped: ")))
    elif call.excinfo is not None:  # this rank's own error (a world error names the rank that caused it)
        outcome = unfinished(label, call.excinfo.value)
    else:  # passed here, failed on other ranks (torchrun): the first of their own errors
        here = launch.joined()
        outcome = failed_elsewhere(label, failed_ranks, None if here is None else here.rank)
    session.record_item(label, ablation_name, outcome, override=bool(failed_ranks) and not rep.skipped)
