"""The run's parity session: it runs checks and ablations, keeps what they said (verdicts, kill results, and how
an item ended without one) and builds the report from it. Under torchrun every rank's item outcome is agreed first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from harness.inputs import checkpoints, compat, host
from harness.judging import ablation as ablation_mod
from harness.judging import checks
from harness.judging.ablation import KillResult
from harness.judging.checks import CheckContext
from harness.judging.compare import Verdict
from harness.judging.items import parity_item
from harness.plugins import conformance
from harness.plugins.conformance_run import GUARDED_KEY, NOT_JUDGED_KEY, ImplementationWatch
from harness.process import launch
from harness.process.dist import WorldTaskError, stable_error
from harness.reports import bench, report
from harness.reports.report import Unfinished

__all__ = ["CAUSES", "OUTCOME_ERRORS", "SESSION_KEY", "CheckFailedEarlier", "ParitySession", "failed_elsewhere",
           "first_line", "settle_report", "skip_unavailable_path", "unfinished"]

SESSION_KEY = pytest.StashKey["ParitySession"]()


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
        self.other_failures: list[str] = []  # tests that are no parity item and failed: "nodeid (phase: Type)"

    def context(self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                checkpoint: str | None = None) -> CheckContext:
        device = torch.device(device)
        key = (device.type, dtype, checkpoint)
        if key not in self._contexts:
            from harness.process.dist import WorldPool

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
                verdict = self._judge(check_id, ctx or self.context())
                self.verdicts[key] = dataclasses.replace(verdict, check_id=key) if label else verdict
        except OUTCOME_ERRORS as err:
            self.unfinished[key] = unfinished(key, err)
            raise
        self.unfinished.pop(key, None)
        return self.verdicts[key]

    def _judge(self, check_id: str, ctx: CheckContext) -> Verdict:
        """Run one check; under ``--impl`` on the implementation that drives it, held to having called it, and
        under the guard contract where it feeds an input class that implementation declares unsupported."""
        path = checks.get(check_id).path
        found = conformance.select(check_id) if conformance.given() else None
        conformance.reset_outcomes(path)
        watch = ImplementationWatch(path)
        if found is None or found.mode != conformance.GUARDED:
            return watch.require_ran(checks.run_check(check_id, ctx))
        verdict, error = None, None
        try:
            verdict = checks.run_check(check_id, ctx)
        except Exception as err:  # noqa: BLE001 - a refusal is how the guard contract may be met
            error = err
        made = conformance.outcomes(path)
        if error is not None and made.refused == 0:
            raise error  # the check failed on its own, not by a refusal of the implementation under test
        every_rank = not isinstance(error, WorldTaskError) or all(o.status == "raised" for o in error.outcomes)
        guarded = conformance.guard_verdict(path, found.reason, made, verdict, error, every_rank)
        return watch.require_ran(dataclasses.replace(guarded, check_id=guarded.check_id or check_id))

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
        kills: list[KillResult | Unfinished] = [*sorted(self.kills, key=_pair_order()),
                                                *(self.pairs_unfinished[p] for p in sorted(self.pairs_unfinished))]
        remote = ({"trusted": True, "ran": checkpoints.remote_code_ran()}
                  if self.config.getoption("trust_remote_code") else None)
        data = report.build([rows[k] for k in sorted(rows, key=rank)], kills, implementations=conformance.specs(),
                            remote_code=remote, host=host.fingerprint(),
                            benchmarks=self.benchmarks.to_json() if self.benchmarks else None)
        not_judged = self.config.stash.get(NOT_JUDGED_KEY, {})
        if not_judged:  # conformance mode: the checks deselected because they cannot call the user's code
            data["not_judged"] = dict(sorted(not_judged.items()))
        guarded = self.config.stash.get(GUARDED_KEY, {})
        if guarded:  # conformance mode: the checks judged under the guard contract, and why
            data["guarded"] = dict(sorted(guarded.items()))
        declared = {key: declared.describe() for key, (_, declared) in conformance.given().items()
                    if not declared.describe().endswith("()")}
        if declared:
            data["declarations"] = declared
        return data

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def _pair_order() -> Callable[[KillResult], tuple[int, int]]:
    """Where a kill pair stands in the kill matrix: its ablation's place in the registry, then its check's place in
    that ablation's claims, the order a serial run makes them in; a run split over workers reports the same order."""
    known = {a.name: (index, a.kills) for index, a in enumerate(ablation_mod.all_ablations())}

    def rank(result: KillResult) -> tuple[int, int]:
        index, claims = known.get(result.ablation, (len(known), ()))
        check = result.check.split("[", 1)[0]
        return index, list(claims).index(check) if check in claims else len(claims)

    return rank


class CheckFailedEarlier(RuntimeError):
    """A check that already raised in this session is asked for again (a kill item's baseline, say)."""

# what a check may end with besides a verdict: any error, pytest's skip and fail outcomes
OUTCOME_ERRORS = (Exception, pytest.skip.Exception, pytest.fail.Exception)


def first_line(text: str, limit: int = 400) -> str:
    """The first non-blank line of ``text``, its per-run details replaced (harness.process.dist.stable_error)."""
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    return stable_error(line)[:limit]


CAUSES = ("raised", "stuck", "died", "hung")  # a rank's own failure; "blocked" only waited for one of these


def unfinished(check_label: str, err: BaseException, ablation_name: str = "") -> Unfinished:
    """How a check (or pair) ended without a verdict: skipped with its reason, or failed with type, message, ranks."""
    if isinstance(err, pytest.skip.Exception):
        return Unfinished(check_label, "skipped", first_line(str(err.msg or "")), ablation=ablation_name)
    message = first_line(str(err))
    ranks: tuple[int, ...] = ()
    if isinstance(err, WorldTaskError):
        # the ranks that caused it, not those that only waited for them (blocked) or this rank answering for them
        bad = [o for o in err.outcomes if o.status != "ok"]
        culprits = [o for o in bad if o.status in CAUSES] or bad
        ranks = tuple(o.rank for o in culprits)
        if culprits:
            message = f"{message}: {first_line(culprits[0].line())}"
    elif launch.joined() is not None:
        ranks = (launch.joined().rank,)
    return Unfinished(check_label, "failed", message, type(err).__name__, ranks, ablation_name)


def settle_report(item: pytest.Item, call: pytest.CallInfo[None], rep: pytest.TestReport) -> pytest.TestReport:
    """Under torchrun every rank reports each phase alike: a failure on any rank fails it on every rank.

    Ranks agree phase by phase over the launcher's board (harness.process.launch), so no rank runs a call that
    another rank's failed or skipped setup did not reach (which would leave the ranks out of step); a rank
    that stopped or died is reported failed within the fault bound. Then a parity item that failed or
    skipped before its check gave a verdict is recorded for the report.
    """
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
        return first_line(f"{call.excinfo.typename}: {call.excinfo.value}")
    return rep.longreprtext.strip().splitlines()[-1][:400]


def failed_elsewhere(label: str, failed_ranks: list[tuple[int, str]], here: int | None) -> Unfinished:
    """An item that passed on this rank and failed on others: the first other rank's own error, and only the
    ranks where it failed (not this one)."""
    others = [(r, text) for r, text in failed_ranks if r != here] or failed_ranks
    return Unfinished(label, "failed", f"rank {others[0][0]}: {first_line(others[0][1])}", "failed on another rank",
                      tuple(r for r, _ in others))


def _record_item(item: pytest.Item, call: pytest.CallInfo[None], rep: pytest.TestReport,
                 failed_ranks: list[tuple[int, str]]) -> None:
    """A parity item that failed or skipped without its check recording why: the report gets the item's reason. Any
    other test that failed is named for the report too (it fails the run, and the report must not read green)."""
    session = item.config.stash.get(SESSION_KEY, None)
    found = parity_item(item)
    if session is not None and found is None and rep.failed:
        what = call.excinfo.typename if call.excinfo is not None else "failed on another rank"
        session.other_failures.append(f"{item.nodeid} ({call.when}: {what})")
    if not (rep.failed or rep.skipped) or call.when == "teardown":
        return
    if session is None or found is None:
        return
    label, ablation_name = found.report_label, found.ablation
    if rep.skipped:
        text = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        outcome = Unfinished(label, "skipped", first_line(text.removeprefix("Skipped: ")))
    elif call.excinfo is not None:  # this rank's own error (a world error names the rank that caused it)
        outcome = unfinished(label, call.excinfo.value)
    else:  # passed here, failed on other ranks (torchrun): the first of their own errors
        here = launch.joined()
        outcome = failed_elsewhere(label, failed_ranks, None if here is None else here.rank)
    session.record_item(label, ablation_name, outcome, override=bool(failed_ranks) and not rep.skipped)
