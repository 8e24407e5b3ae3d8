"""Verdicts and kill results -> one report: a terminal table, markdown, or JSON.

The JSON shape is a contract for CI tools::

    {"host": {...},                                   # where it ran: torch, CPU capability, MKL/oneDNN, threads
     "implementations": {path: "module:callable"},   # only in conformance mode (--impl)
     "checks": [{"id", "path", "where", "passed", "metrics", "policy", "margin"}],
     "ablations": [{"name", "path", "kill_mode", "kills": [{"check", "killed", "mode", "declared", "margin"}]}],
     "summary": {"checks", "passed", "ablations", "killed"}}

Nothing time-dependent goes in, so the same run gives the same report.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from harness import ablation, checks
from harness.ablation import KillResult
from harness.compare import Verdict
from harness.host import summary as host_summary

__all__ = ["build", "render_markdown", "render_terminal", "write"]


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


def build(verdicts: Iterable[Verdict], kills: Iterable[KillResult],
          implementations: Mapping[str, str] | None = None, host: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The report; ``implementations`` names the implementation under test per path (conformance mode),
    ``host`` where the run happened (``harness.host.fingerprint``)."""
    rows = []
    for v in verdicts:
        registered = checks.get(v.check_id) if checks.exists(v.check_id) else None
        rows.append({
            "id": v.check_id,
            "path": v.path,
            "where": registered.where if registered else "",
            "passed": v.passed,
            "metrics": _plain(v.metrics),
            "policy": v.policy,
            "margin": _plain(v.margin),
            "headline": v.headline,
            "tolerance": _plain(v.tolerance),
        })
    grouped: dict[str, list[KillResult]] = {}
    for k in kills:
        grouped.setdefault(k.ablation, []).append(k)
    ablations = []
    for name, results in grouped.items():
        known = ablation.get(name) if name in ablation._ABLATIONS else None
        ablations.append({
            "name": name,
            "path": name.split(".", 1)[0],
            "kill_mode": known.kill_mode if known else "",
            "kills": [{"check": r.check, "killed": r.killed, "mode": r.mode, "declared": r.declared,
                       "margin": _plain(r.margin), "how": r.how, "headline": r.headline,
                       "metrics": _plain(r.metrics)} for r in results],
        })
    summary = {
        "checks": len(rows),
        "passed": sum(c["passed"] for c in rows),
        "ablations": len(ablations),
        "killed": sum(all(k["killed"] for k in a["kills"]) for a in ablations),
    }
    built: dict[str, Any] = {"checks": rows, "ablations": ablations, "summary": summary}
    if implementations:
        built = {"implementations": dict(sorted(implementations.items())), **built}
    if host is not None:
        built = {"host": _plain(dict(host)), **built}
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


def _headline(check: dict[str, Any]) -> str:
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


def _clip(text: str, width: int | None) -> str:
    return text if width is None or len(text) <= width else text[: width - 3] + "..."


def _rows(report: dict[str, Any], width: int | None = None) -> tuple[list[list[str]], list[list[str]]]:
    """Table rows; ``width`` clips the headline column (the terminal), markdown keeps it whole."""
    checks = [["PASS" if c["passed"] else "FAIL", c["id"], _clip(_headline(c), width), _num(c["tolerance"]),
               _num(c["margin"])] for c in report["checks"]]
    ablations = []
    for a in report["ablations"]:
        killed = sum(k["killed"] for k in a["kills"])
        status = "KILLED" if killed == len(a["kills"]) else "SURVIVED"
        ablations.append([status, a["name"], a.get("kill_mode", ""), f"{killed}/{len(a['kills'])}",
                          _smallest_margin(a["kills"])])
    return checks, ablations


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=False))
    out = [line, "-" * len(line)]
    out.extend("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=False)) for row in rows)
    return out


def _under_test(report: dict[str, Any]) -> list[tuple[str, str]]:
    """(path, spec) per path whose checks judged a user's implementation instead of the suite's own."""
    return list(report.get("implementations", {}).items())


def render_terminal(report: dict[str, Any]) -> str:
    checks, ablations = _rows(report, width=88)
    lines = [f"implementation under test for {path}: {spec}" for path, spec in _under_test(report)]
    if lines:
        lines.append("")
    if checks:
        lines += _table(["", "check", "headline", "tolerance", "margin"], checks)
    if ablations:
        lines += ["", *_table(["", "ablation", "kill mode", "killed", "smallest kill margin"], ablations)]
    s = report["summary"]
    lines += ["", f"checks: {s['passed']}/{s['checks']} passed; ablations: {s['killed']}/{s['ablations']} killed all "
              "their checks"]
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
    lines += [f"**implementation under test for {path}**: `{spec}`  " for path, spec in _under_test(report)]
    lines += [f"**checks** {s['passed']}/{s['checks']} passed · **ablations** {s['killed']}/{s['ablations']} killed",
              ""]
    if "host" in report:
        lines += [f"**host** {host_summary(report['host'])}", ""]
    if checks:
        lines += ["## Parity checks", "", *md(["status", "check", "headline", "tolerance", "margin"], checks), ""]
    if ablations:
        header = ["status", "ablation", "kill mode", "killed", "smallest kill margin"]
        lines += ["## Ablations", "", *md(header, ablations), ""]
    if report["ablations"]:
        lines += ["## What each ablation did to each check it claims", ""]
        for a in report["ablations"]:
            lines.append(f"- **{a['name']}**")
            lines += [f"  - `{k['check']}`: {'killed' if k['killed'] else 'SURVIVED'} by {k['how']}"
                      + (f" (declared {k['declared']})" if k.get("declared") and k["declared"] != k.get("mode") else "")
                      + (f", {k['headline']}" if k.get("headline") else "")
                      + (f", margin {_num(k['margin'])}" if isinstance(k["margin"], float) else "") for k in a["kills"]]
        lines.append("")
    failures = [c for c in report["checks"] if not c["passed"]]
    if failures:
        lines += ["## Failures", ""]
        lines += [f"- `{c['id']}` under {c['policy']}: {_headline(c)}" for c in failures]
    return "\n".join(lines) + "\n"


def write(report: dict[str, Any], path: str | Path) -> Path:
    """Write ``.md`` or ``.json`` by suffix; anything else is a usage mistake."""
    target = Path(path)
    if target.suffix not in (".md", ".json"):
        raise ValueError(f"--parity-report {path!r}: the file must end in .md or .json")
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.suffix == ".json":
        target.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    else:
        target.write_text(render_markdown(report))
    return target
