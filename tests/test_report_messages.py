"""What a report row says: a long message is shortened only in the terminal table, at a word boundary, and a check
failed by a required condition names that condition instead of showing a passing-looking margin."""

from __future__ import annotations

import json

import pytest

from fixtures import check_upstream
from harness.judging.compare import Verdict, holds
from harness.reports import report
from harness.reports.report import Unfinished, shorten

pytestmark = pytest.mark.cpu

LONG = ("MoE routing depends on what shares the forward (single-token path: a token alone in a forward of one, every "
        "B=1 decode step, is weighted differently from the same token in a batch, layer 0)")


def _row(rendered: str, check_id: str) -> str:
    return next(line for line in rendered.splitlines() if f" {check_id} " in line)


def test_shorten_cuts_at_a_word_boundary_with_an_ellipsis():
    cut = shorten(LONG, 160)
    assert len(cut) <= 160 and cut.endswith("...")
    assert cut == LONG[: len(cut) - 3] + "..." and LONG[len(cut) - 3] == " "  # whole words only, nothing half
    assert cut == ("MoE routing depends on what shares the forward (single-token path: a token alone in a forward of "
                   "one, every B=1 decode step, is weighted differently from the...")
    assert shorten(LONG, len(LONG)) == LONG and shorten(LONG, None) == LONG
    assert shorten("x" * 50, 20) == "x" * 17 + "..."  # one word longer than the cell: cut inside it


def test_the_terminal_shortens_a_long_reason_and_the_markdown_and_json_keep_it_whole(tmp_path):
    built = report.build([Unfinished("ar.gpu.batched_vs_b1[gen1_moe-fp32]", "skipped", LONG)], [])
    row = _row(report.render_terminal(built), "ar.gpu.batched_vs_b1[gen1_moe-fp32]")
    assert "skipped: MoE routing depends on what shares the forward (single-token path: a token...  -" in row
    assert f"skipped: {LONG}" in report.render_markdown(built)
    report.write(built, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["checks"][0]["reason"] == LONG


def test_a_check_failed_by_a_fact_names_it_instead_of_a_passing_margin():
    numbers_pass = Verdict("replay.cfg2.log_probs", True, {"max_abs": 1e-7}, "close(atol=8e-7)", 0.125,
                           headline="max_abs", tolerance=8e-7).require(False, "one batched forward ran")
    built = report.build([numbers_pass], [])
    assert built["checks"][0]["violated"] == ["one batched forward ran"]
    assert built["checks"][0]["margin"] == 0.125  # the data keeps the number
    row = _row(report.render_terminal(built), "replay.cfg2.log_probs")
    assert row.startswith("FAIL") and "fact failed: one batched forward ran" in row
    assert row.rstrip().endswith("fact failed") and "1.250e-01" not in row
    markdown = report.render_markdown(built)
    assert ("| FAIL | replay.cfg2.log_probs | fact failed: one batched forward ran | 8.000e-07 | fact failed |"
            in markdown)
    assert "- `replay.cfg2.log_probs` under close(atol=8e-7): fact failed: one batched forward ran" in markdown
    assert "(the numbers pass; fact failed: one batched forward ran)" in numbers_pass.describe()


def test_a_fact_on_a_check_whose_numbers_failed_too_keeps_the_failing_margin():
    both = Verdict("ar.greedy.tokens", False, {"max_ulp": 9}, "ulp(2)", 4.5, headline="max_ulp",
                   tolerance=2).require(False, "the static cache was used")
    row = _row(report.render_terminal(report.build([both], [])), "ar.greedy.tokens")
    assert "fact failed: the static cache was used" in row and row.rstrip().endswith("4.500e+00")
    assert "the numbers pass" not in both.describe()


def test_a_bare_fact_and_passing_facts():
    fact = holds(False, "the guard returned None", returned="a tensor")
    stamped = Verdict("decode.t37.gate", fact.passed, fact.metrics, fact.policy, fact.margin, notes=fact.notes)
    passing = Verdict("decode.t37.w8.bitexact", True, {"max_ulp": 0}, "exact", 0.0, headline="max_ulp").require(
        True, "eight ranks decoded")
    built = report.build([stamped, passing], [])
    assert [c["violated"] for c in built["checks"]] == [["the guard returned None"], []]
    rendered = report.render_terminal(built)
    assert "fact failed: the guard returned None" in _row(rendered, "decode.t37.gate")
    assert _row(rendered, "decode.t37.gate").rstrip().endswith("fact failed")
    assert "max_ulp=0" in _row(rendered, "decode.t37.w8.bitexact")


def test_check_upstream_names_the_failed_fact():
    data = {"checks": [{"id": "ar.gpu.batched_vs_b1[gen2_moe-fp32]", "passed": False, "margin": 0.125,
                        "violated": ["the static cache was used"], "metrics": {"logp_max_abs": 1e-6}}]}
    assert check_upstream.summarize(data)[("gen2_moe", "fp32")]["why"] == "fact failed: the static cache was used"
