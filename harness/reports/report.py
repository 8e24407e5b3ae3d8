"""Verdicts and kill results -> one report: a terminal table, markdown, JSON, or HTML with pictures.

The JSON shape is a contract for CI tools::

    {"host": {...},                                   # where it ran: torch, CPU capability, MKL/oneDNN, threads
     "implementations": {path: "module:callable"},   # only in conformance mode (--impl)
     "remote_code": {"trusted": bool, "ran": [dir]},  # only when the run passed --trust-remote-code
     "checks": [{"id", "path", "where", "status", "passed", "metrics", "policy", "margin", "violated", "message",
                 "error": {"type", "message", "ranks"} | "reason": str}],   # error: failed with no verdict;
                                                     # message: what failed, in the verdict's words ("" on a pass)
     "ablations": [{"name", "path", "kill_mode", "status",
                    "kills": [{"check", "status", "killed", "mode", "declared", "margin", ...}]}],
     "summary": {"checks", "passed", "failed", "skipped", "ablations", "killed",
                 "pairs", "pairs_killed", "pairs_survived", "pairs_failed", "pairs_skipped"},
     "not_judged": {check_id: reason},               # only in conformance mode: checks that cannot call it, or
                                                     # lie outside what the implementations declare
     "guarded": {check_id: reason},                  # only in conformance mode: checks fed an input class the
                                                     # implementation declares unsupported (the guard contract)
     "declarations": {"path[.subject]": declaration}, # only in conformance mode: what each implementation declares
     "nothing_ran": [line],                          # only when a given --checkpoint, --capture-dir or --impl
                                                     # had no check run on it: one line each, naming why
     "interrupted": line,                            # only when the run was stopped (Ctrl-C, SIGTERM, SIGHUP)
                                                     # before every item ran: what stopped it
     "not_green": line,                              # only when pytest exits non-zero while every check passed
                                                     # and every pair was killed: the exit status and why (a test
                                                     # outside the parity checks that failed, say)
     "benchmarks": {table: {"path", "title", "rows": [{"case", "fast_s", "stock_s", "raw_s", "raw_stock_s",
                    "ideal", "ratios", "extra"}]}}}  # only when bench items ran (harness.reports.bench); timings

A check's status is passed, failed (its verdict failed; or it raised, timed out or failed before giving
one: then ``error`` says how and on which ranks) or skipped (``reason``); a pair's is killed, survived
(the ablated check ran and was not killed in its declared mode), failed (it never got to run the ablated
check: its baseline failed or raised) or skipped. Every collected check and pair is in, so the report
never reads greener than the run. Nothing time-dependent or per-run (ports, pids) goes in, so the same
command gives the same report.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.judging import ablation
from harness.judging import checks
from harness.reports import report_pictures
from harness.judging.ablation import KillResult
from harness.judging.compare import Verdict
from harness.inputs.host import summary as host_summary
from harness.paths import path_of

__all__ = ["SUFFIXES", "Unfinished", "build", "prepare", "render_html", "render_markdown", "render_terminal", "shorten",
           "write"]

SUFFIXES = (".md", ".json", ".html")
SUFFIX_TEXT = ".md, .json or .html"


@dataclass(frozen=True)
class Unfinished:
    """A check, or an (ablation, check) pair, that gave no verdict: it raised, timed out, failed first, or skipped.

    ``status`` is "failed" or "skipped"; ``reason`` the skip reason or the exception's message;
    ``error_type`` the exception's type and ``ranks`` the ranks it failed on (empty: this process).
    """

    check: str
    status: str
    reason: str
    error_type: str = ""
    ranks: tuple[int, ...] = ()
    ablation: str = ""  # set for a pair

    def fields(self) -> dict[str, Any]:
        if self.status == "skipped":
            return {"reason": self.reason}
        return {"error": {"type": self.error_type, "message": self.reason, "ranks": list(self.ranks)}}


def _plain(value: Any) -> Any:
    """JSON-safe values: non-finite floats become strings, tensors and tuples become lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist"):
        return _plain(value.tolist())
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


def _check_row(v: Verdict | Unfinished) -> dict[str, Any]:
    check_id = v.check_id if isinstance(v, Verdict) else v.check
    registered = checks.get(check_id) if checks.exists(check_id) else None
    row: dict[str, Any] = {"id": check_id, "path": path_of(check_id),
                           "where": registered.where if registered else ""}
    if isinstance(v, Unfinished):
        return {**row, "status": v.status, "passed": False, "metrics": {}, "policy": "", "margin": None,
                "headline": None, "tolerance": None, **v.fields()}
    return {**row, "status": "passed" if v.passed else "failed", "passed": v.passed, "metrics": _plain(v.metrics),
            "policy": v.policy, "margin": _plain(v.margin), "headline": v.headline, "tolerance": _plain(v.tolerance),
            "violated": v.violated_facts, "message": "" if v.passed else v.message}


def _kill_row(r: KillResult | Unfinished, declared: str) -> dict[str, Any]:
    if isinstance(r, Unfinished):
        return {"check": r.check, "status": r.status, "killed": False, "mode": r.status, "declared": declared,
                "margin": None, "how": r.reason, "headline": "", "metrics": {}, **r.fields()}
    return {"check": r.check, "status": "killed" if r.killed else "survived", "killed": r.killed, "mode": r.mode,
            "declared": r.declared, "margin": _plain(r.margin), "how": r.how, "headline": r.headline,
            "metrics": _plain(r.metrics)}


def _ablation_status(kills: list[dict[str, Any]]) -> str:
    """killed only when every claimed pair was run and killed; otherwise the worst thing that happened."""
    statuses = {k["status"] for k in kills}
    for status in ("failed", "survived", "skipped"):
        if status in statuses:
            return status
    return "killed"


def build(verdicts: Iterable[Verdict | Unfinished], kills: Iterable[KillResult | Unfinished],
          implementations: Mapping[str, str] | None = None,
          remote_code: Mapping[str, Any] | None = None, host: Mapping[str, Any] | None = None,
          benchmarks: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The report; ``implementations`` names the implementation under test per path (conformance mode),
    ``remote_code`` what the run allowed and loaded of checkpoints' own code (--trust-remote-code), ``host``
    where the run happened (``harness.inputs.host.fingerprint``), ``benchmarks`` what its bench items measured
    (``harness.reports.bench.BenchLog.to_json``)."""
    rows = [_check_row(v) for v in verdicts]
    grouped: dict[str, list[KillResult | Unfinished]] = {}
    for k in kills:
        grouped.setdefault(k.ablation, []).append(k)
    ablations = []
    for name, results in grouped.items():
        known = ablation.get(name) if name in ablation.ABLATIONS else None
        pairs = [_kill_row(r, known.mode_for(r.check) if known and isinstance(r, Unfinished) else "")
                 for r in results]
        ablations.append({
            "name": name,
            "path": path_of(name),
            "kill_mode": known.kill_mode if known else "",
            "status": _ablation_status(pairs),
            "kills": pairs,
        })
    pairs = [k for a in ablations for k in a["kills"]]
    summary = {
        "checks": len(rows),
        "passed": sum(c["status"] == "passed" for c in rows),
        "failed": sum(c["status"] == "failed" for c in rows),
        "skipped": sum(c["status"] == "skipped" for c in rows),
        "ablations": len(ablations),
        "killed": sum(a["status"] == "killed" for a in ablations),
        "pairs": len(pairs),
        **{f"pairs_{status}": sum(k["status"] == status for k in pairs)
           for status in ("killed", "survived", "failed", "skipped")},
    }
    built: dict[str, Any] = {"checks": rows, "ablations": ablations, "summary": summary}
    if remote_code is not None:
        built = {"remote_code": _plain(dict(remote_code)), **built}
    if implementations:
        built = {"implementations": dict(sorted(implementations.items())), **built}
    if host is not None:
        built = {"host": _plain(dict(host)), **built}
    if benchmarks:
        built["benchmarks"] = _plain(dict(benchmarks))
    return built


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.3e}" if value and math.isfinite(value) else repr(value)
    return str(value)


def _facts_failed(check: dict[str, Any]) -> str:
    """The conditions a failed check violated; "" when its numbers alone failed it (or it passed)."""
    facts = (check.get("violated") or []) if check["status"] == "failed" else []
    return f"fact failed: {'; '.join(facts)}" if facts else ""


def _headline(check: dict[str, Any]) -> str:
    if "error" in check:
        ranks = check["error"]["ranks"]
        where = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else ""
        return f"{check['error']['type']}{where}: {check['error']['message']}"
    if "reason" in check:
        return f"skipped: {check['reason']}"
    facts = _facts_failed(check)
    if facts:  # a failed fact leads, so the row never reads like a pass on its numbers
        return facts
    name = check.get("headline")
    if not name:
        shown = [f"{k}={_num(v)}" for k, v in check["metrics"].items() if not isinstance(v, (list, dict))][:2]
        return ", ".join(shown) or "-"
    return f"{name}={_num(check['metrics'].get(name))}"


def _smallest_margin(kills: list[dict[str, Any]]) -> str:
    margins = [k["margin"] for k in kills if k["killed"] and isinstance(k["margin"], (int, float))]
    if margins:
        return _num(float(min(margins)))
    if any(k["killed"] and k["margin"] == "inf" for k in kills):
        return "inf"
    other = sorted({k.get("mode") or k["how"] for k in kills if k["killed"]})  # "raises", "fact", "hang"
    return ", ".join(other) or "-"


def shorten(text: str, width: int | None) -> str:
    """``text`` in at most ``width`` characters for a table cell: cut at a word boundary and ended with "...".

    Only cells are shortened; the markdown and JSON reports keep every message whole.
    """
    if width is None or len(text) <= width:
        return text
    room = max(width - 3, 1)
    cut = text[:room]
    if text[room] != " " and " " in cut[room // 2:]:  # mid-word: back to the last space, unless it is far back
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip(" ,;:(-") + "..."


def _margin(check: dict[str, Any]) -> str:
    """The margin column; a check failed by a fact whose numbers pass (margin <= 1, or none) says so instead."""
    margin = check["margin"]
    numbers_failed = margin in ("inf", "nan") or (isinstance(margin, (int, float)) and margin > 1)
    return "fact failed" if _facts_failed(check) and not numbers_failed else _num(margin)


def _rows(report: dict[str, Any], width: int | None = None) -> tuple[list[list[str]], list[list[str]]]:
    """Table rows; ``width`` clips the headline column (the terminal), markdown keeps it whole."""
    labels = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}
    checks = [[labels[c["status"]], c["id"], shorten(_headline(c), width), _num(c["tolerance"]), _margin(c)]
              for c in report["checks"]]
    ablations = []
    for a in report["ablations"]:
        killed = sum(k["killed"] for k in a["kills"])
        others = {s: sum(k["status"] == s for k in a["kills"]) for s in ("failed", "skipped")}
        count = f"{killed}/{len(a['kills'])}" + "".join(f", {n} {s}" for s, n in others.items() if n)
        ablations.append([a["status"].upper(), a["name"], a.get("kill_mode", ""), count,
                          _smallest_margin(a["kills"])])
    return checks, ablations


def _summary_line(s: dict[str, Any]) -> str:
    """One line; a run with anything failed or skipped says so next to the pass count."""
    line = f"checks: {s['passed']}/{s['checks']} passed"
    line += "".join(f", {s[k]} {k}" for k in ("failed", "skipped") if s.get(k))
    line += f"; ablations: {s['killed']}/{s['ablations']} killed all their checks"
    extra = [f"{s[f'pairs_{k}']} {k}" for k in ("survived", "failed", "skipped") if s.get(f"pairs_{k}")]
    if extra:
        line += f" ({s['pairs_killed']}/{s['pairs']} pairs killed, {', '.join(extra)})"
    return line


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=False))
    out = [line, "-" * len(line)]
    out.extend("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=False)) for row in rows)
    return out


def _under_test(report: dict[str, Any]) -> list[tuple[str, str]]:
    """(path, spec) per path (or "path.subject") whose checks judged a user's implementation, its declaration
    beside it."""
    declared = report.get("declarations", {})
    return [(key, f"{spec} declaring {declared[key]}" if key in declared else spec)
            for key, spec in report.get("implementations", {}).items()]


def _by_reason(reasons: Mapping[str, str]) -> list[tuple[str, list[str]]]:
    grouped: dict[str, list[str]] = {}
    for check_id, reason in sorted(reasons.items()):
        grouped.setdefault(reason, []).append(check_id)
    return list(grouped.items())


def _conformance_lines(report: dict[str, Any]) -> list[str]:
    """One line each: how many checks a conformance run excluded and how many it judged under the guard contract."""
    lines = []
    if report.get("not_judged"):
        outside = sum(r.startswith("outside what") for r in report["not_judged"].values())
        lines.append(f"not judged: {len(report['not_judged'])} checks (deselected, neither passed nor failed"
                     + (f"; {outside} outside what the implementations declare" if outside else "") + ")")
    if report.get("guarded"):
        lines.append(f"guard contract: {len(report['guarded'])} checks feed an input class an implementation declares "
                     "unsupported (it must refuse it or take the stock path)")
    return lines


def _lead(report: dict[str, Any]) -> list[str]:
    """What a report says before anything else: that the run was interrupted, or is not green though its tables
    read so."""
    return [report[key] for key in ("interrupted", "not_green") if report.get(key)]


def render_terminal(report: dict[str, Any]) -> str:
    checks, ablations = _rows(report, width=88)
    lines = [*_lead(report), ""] if _lead(report) else []
    lines += [f"implementation under test for {path}: {spec}" for path, spec in _under_test(report)]
    if lines:
        lines.append("")
    if checks:
        lines += _table(["", "check", "headline", "tolerance", "margin"], checks)
    if ablations:
        lines += ["", *_table(["", "ablation", "kill mode", "killed", "smallest kill margin"], ablations)]
    lines += ["", _summary_line(report["summary"]), *_conformance_lines(report)]
    if report.get("not_green"):  # beside the counts it qualifies, too: the last lines are what a reader sees
        lines.append(report["not_green"])
    if "host" in report:
        lines.append(f"host: {host_summary(report['host'])}")
    return "\n".join(lines)


def render_markdown(report: dict[str, Any]) -> str:
    checks, ablations = _rows(report)

    def md(header: list[str], rows: list[list[str]]) -> list[str]:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(x.replace("|", "\\|") for x in row) + " |" for row in rows]
        return out

    s = report["summary"]
    lines = ["# Parity report", ""]
    for lead in _lead(report):
        lines += [f"**{lead}**", ""]
    lines += [f"**implementation under test for {path}**: `{spec}`  " for path, spec in _under_test(report)]
    remote = report.get("remote_code")
    if remote is not None:
        ran = ", ".join(f"`{d}`" for d in remote["ran"]) or "none loaded"
        lines.append(f"**remote code** allowed (--trust-remote-code); ran from: {ran}  ")
    counts = "".join(f", {s[k]} {k}" for k in ("failed", "skipped") if s.get(k))
    pairs = "".join(f", {s[f'pairs_{k}']} pairs {k}" for k in ("survived", "failed", "skipped") if s.get(f"pairs_{k}"))
    lines += [f"**checks** {s['passed']}/{s['checks']} passed{counts} · **ablations** {s['killed']}/{s['ablations']} "
              f"killed{pairs}", ""]
    lines += [f"**{line.split(':', 1)[0]}**:{line.split(':', 1)[1]}  " for line in _conformance_lines(report)]
    if "host" in report:
        lines += [f"**host** {host_summary(report['host'])}", ""]
    if report.get("nothing_ran"):
        lines += ["## Inputs no check ran on (the run fails)", "", *(f"- {line}" for line in report["nothing_ran"]), ""]
    pictures = report_pictures.markdown_section(report)
    if pictures:
        lines += [pictures, ""]
    if checks:
        lines += ["## Parity checks", "", *md(["status", "check", "headline", "tolerance", "margin"], checks), ""]
    if ablations:
        header = ["status", "ablation", "kill mode", "killed", "smallest kill margin"]
        lines += ["## Ablations", "", *md(header, ablations), ""]
    if report["ablations"]:
        lines += ["## What each ablation did to each check it claims", ""]
        for a in report["ablations"]:
            lines.append(f"- **{a['name']}**")
            lines += [f"  - `{k['check']}`: " + ({"killed": "killed", "survived": "SURVIVED"}.get(k["status"])
                                                  or k["status"].upper()) + f" by {k['how']}"
                      + (f" (declared {k['declared']})" if k.get("declared") and k["declared"] != k.get("mode") else "")
                      + (f", {k['headline']}" if k.get("headline") else "")
                      + (f", margin {_num(k['margin'])}" if isinstance(k["margin"], float) else "") for k in a["kills"]]
        lines.append("")
    failures = [c for c in report["checks"] if c["status"] == "failed"]
    if failures:
        lines += ["## Failures", ""]
        lines += [f"- `{c['id']}`" + (f" under {c['policy']}" if c["policy"] else "") + f": {_headline(c)}"
                  for c in failures]
        lines.append("")
    skipped = [c for c in report["checks"] if c["status"] == "skipped"]
    if skipped:
        lines += ["## Skipped", ""]
        lines += [f"- `{c['id']}`: {c['reason']}" for c in skipped]
        lines.append("")
    if report.get("guarded"):
        lines += ["## Judged under the guard contract (declared unsupported: refuse or take the stock path)", ""]
        lines += [f"- {reason}: " + ", ".join(f"`{i}`" for i in ids) for reason, ids in _by_reason(report["guarded"])]
        lines.append("")
    if report.get("not_judged"):
        lines += ["## Not judged (excluded: neither passed nor failed), by reason", ""]
        lines += [f"- {reason}: " + ", ".join(f"`{i}`" for i in ids) for reason, ids in _by_reason(report["not_judged"])]
    return "\n".join(lines).rstrip("\n") + "\n"


def render_html(report: dict[str, Any]) -> str:
    """One standalone page: the summary, every picture (text when matplotlib is missing), the two tables."""
    checks, ablations = _rows(report)
    lines = _lead(report)
    lines += [f"implementation under test for {path}: {spec}" for path, spec in _under_test(report)]
    lines += [_summary_line(report["summary"]), *_conformance_lines(report), *report.get("nothing_ran", [])]
    if "host" in report:
        lines.append(f"host: {host_summary(report['host'])}")
    tables = [("Parity checks", ["status", "check", "headline", "tolerance", "margin"], checks),
              ("Ablations", ["status", "ablation", "kill mode", "killed", "smallest kill margin"], ablations)]
    return report_pictures.html_document("Parity report", lines, report_pictures.svgs(report),
                                         report_pictures.text_section(report), tables)


def prepare(path: str | Path) -> Path:
    """Make sure the report can be written at ``path``, now, before any check runs: ValueError naming why not.

    The parent directories are created; the file is opened for writing (and removed again if it did not
    exist), so a path under /proc, below a file, or in a read-only directory stops the run up front.
    """
    target = Path(path)
    if target.suffix not in SUFFIXES:
        raise ValueError(f"--parity-report {path}: the file must end in {SUFFIX_TEXT}")
    if target.is_dir():
        raise ValueError(f"--parity-report {path}: is a directory; expected a file path ending in {SUFFIX_TEXT}")
    existed = target.exists()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("a"):
            pass
    except OSError as err:
        raise ValueError(f"--parity-report {path}: cannot be written ({type(err).__name__}: "
                         f"{err.strerror or err})") from None
    if not existed:
        with contextlib.suppress(OSError):
            os.unlink(target)
    return target


def write(report: dict[str, Any], path: str | Path) -> Path:
    """Write ``.md``, ``.json`` or ``.html`` by suffix; anything else is a usage mistake."""
    target = Path(path)
    if target.suffix not in SUFFIXES:
        raise ValueError(f"--parity-report {path!r}: the file must end in {SUFFIX_TEXT}")
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.suffix == ".json":
        target.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    elif target.suffix == ".html":
        target.write_text(render_html(report))
    else:
        target.write_text(render_markdown(report))
    return target
