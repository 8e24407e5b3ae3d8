"""Mutation results -> the score, the JSON document and the markdown summary."""

from __future__ import annotations

from collections import Counter, defaultdict

__all__ = ["document", "markdown", "score"]

STATUSES = ("killed", "survived", "timeout", "equivalent", "error")
ROW_KEYS = ("file", "line", "function", "operator", "diff", "status", "killed_by")


def score(killed: int, survived: int, timeout: int) -> float:
    """killed / (killed + survived + timeout); equivalent mutants are not in the denominator."""
    judged = killed + survived + timeout
    return round(killed / judged, 4) if judged else 0.0


def document(mutants: list[dict]) -> dict:
    """The JSON report: ``score``, the five counts and every mutant (file, line, function, operator, diff, status,
    killed_by, and ``error`` for one that could not be applied: status ``error``, never in the score)."""
    counts = Counter(m["status"] for m in mutants)
    rows = [{key: m.get(key, "") for key in ROW_KEYS} | ({"error": m.get("error", "")} if m["status"] == "error"
                                                          else {})
            for m in sorted(mutants, key=lambda m: (m["file"], m["line"], m["operator"], m["diff"]))]
    return {"score": score(counts["killed"], counts["survived"], counts["timeout"]),
            "killed": counts["killed"], "survived": counts["survived"], "timeout": counts["timeout"],
            "equivalent": counts["equivalent"], "errors": counts["error"], "mutants": rows}


def _group(file: str) -> str:
    parts = file.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else file


def markdown(doc: dict, *, title: str, notes: list[str], uncovered: set[tuple[str, int]] | None = None) -> str:
    """A reader's summary: the score, a table per path/module, then every survivor and timeout."""
    out = [f"# {title}", "",
           f"**Score {doc['score']:.4f}** = killed / (killed + survived + timeout) = {doc['killed']} / "
           f"({doc['killed']} + {doc['survived']} + {doc['timeout']}); {doc['equivalent']} equivalent mutants "
           "(reviewed, `tools/mutation_score/equivalent_mutants.toml`) are excluded from the score; "
           f"{doc.get('errors', 0)} could not be applied (errors).", ""]
    out += [f"- {note}" for note in notes] + [""]
    for grouping, key in (("path", _group), ("module", lambda file: file)):
        groups: dict[str, Counter] = defaultdict(Counter)
        for m in doc["mutants"]:
            groups[key(m["file"])][m["status"]] += 1
        out += [f"| {grouping} | mutants | killed | survived | timeout | equivalent | errors | score |",
                "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for name in sorted(groups):
            c = groups[name]
            out.append(f"| `{name}` | {sum(c.values())} | {c['killed']} | {c['survived']} | {c['timeout']} | "
                       f"{c['equivalent']} | {c['error']} | {score(c['killed'], c['survived'], c['timeout']):.3f} |")
        out.append("")
    operators: dict[str, Counter] = defaultdict(Counter)
    for m in doc["mutants"]:
        operators[m["operator"]][m["status"]] += 1
    out += ["| operator | mutants | killed | survived | timeout | score |", "|---|---:|---:|---:|---:|---:|"]
    for name in sorted(operators):
        c = operators[name]
        out.append(f"| {name} | {sum(c.values())} | {c['killed']} | {c['survived']} | {c['timeout']} | "
                   f"{score(c['killed'], c['survived'], c['timeout']):.3f} |")
    for status in ("survived", "timeout", "error"):
        rows = [m for m in doc["mutants"] if m["status"] == status]
        out += ["", f"## {status.capitalize()} ({len(rows)})", ""]
        if not rows:
            out.append("none")
        for m in rows:
            old, new = (part[2:] for part in m["diff"].split("\n", 1))
            tag = " (no passing test runs this line)" if uncovered and (m["file"], m["line"]) in uncovered else ""
            tag += f": {m['error']}" if m.get("error") else ""
            where = f" in `{m['function']}`" if m.get("function") else ""
            out.append(f"- `{m['file']}:{m['line']}`{where} {m['operator']}: `{old}` -> `{new}`{tag}")
    stale = doc.get("stale_equivalents", [])
    if stale:
        out += ["", f"## Stale equivalence entries ({len(stale)}): review each again", ""]
        out += [f"- `{e['file']}` `{e['function']}` {e['operator']}: `{e['line']}` -> `{e['mutant']}` "
                f"({e['matching_sites']} matching sites, {e['reviewed_sites']} reviewed)" for e in stale]
    return "\n".join(out) + "\n"
