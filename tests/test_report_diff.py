"""scripts/compare-reports: two reports agree exactly when every verdict that ran in either agrees.

The dispatch-lane step compares a whole-suite report (which also lists the gpu tier's placeholders, skipped
with their reasons) with CPU-tier lane reports; a skipped row holds no verdict and cannot be a difference, but a
check that ran in one and is missing in the other, or changed status, always is.
"""

from __future__ import annotations

import json

import pytest

from harness.reports import report_diff

pytestmark = pytest.mark.cpu


def _report(checks: list[tuple[str, str, float | None]], kills: list[tuple[str, str, str, str]]) -> dict:
    rows = [{"id": cid, "status": status, "passed": status == "passed", "margin": margin}
            for cid, status, margin in checks]
    ablations: dict[str, list[dict]] = {}
    for name, check, status, mode in kills:
        ablations.setdefault(name, []).append({"check": check, "status": status, "killed": status == "killed",
                                               "mode": mode, "margin": 20.0})
    return {"checks": rows, "ablations": [{"name": n, "kills": k} for n, k in ablations.items()]}


BASE = _report([("a.one", "passed", 0.5), ("a.two", "passed", 0.25)],
               [("abl.x", "a.one", "killed", "tolerance")])


def test_identical_reports_agree_and_list_no_move():
    result = report_diff.compare(BASE, BASE)
    assert result.same_verdicts and result.compared_checks == 2 and result.compared_kills == 1
    assert all(move[0] == 0 for move in result.moves)


def test_a_skipped_placeholder_missing_from_the_other_report_is_no_difference():
    whole = _report([("a.one", "passed", 0.5), ("a.two", "passed", 0.25), ("gpu.placeholder", "skipped", None)],
                    [("abl.x", "a.one", "killed", "tolerance"), ("abl.x", "gpu.placeholder", "skipped", "skipped")])
    assert report_diff.compare(whole, BASE).same_verdicts
    assert report_diff.compare(BASE, whole).same_verdicts


def test_a_check_that_ran_in_one_report_only_is_a_difference():
    fewer = _report([("a.one", "passed", 0.5)], [("abl.x", "a.one", "killed", "tolerance")])
    result = report_diff.compare(BASE, fewer)
    assert result.differences == ["check a.two is in A but not in B"]


@pytest.mark.parametrize("status", ["failed", "skipped"])
def test_a_status_change_is_a_difference(status):
    other = _report([("a.one", "passed", 0.5), ("a.two", status, 0.25)], [("abl.x", "a.one", "killed", "tolerance")])
    result = report_diff.compare(BASE, other)
    assert result.differences == [f"check a.two: PASS in A, {status.upper().replace('FAILED', 'FAIL')} in B"]


def test_a_kill_caught_in_another_mode_is_a_difference_and_margins_move_freely():
    other = _report([("a.one", "passed", 5e-7), ("a.two", "passed", 0.25)], [("abl.x", "a.one", "killed", "fact")])
    result = report_diff.compare(BASE, other)
    assert result.differences == ["ablation abl.x -> a.one: killed (tolerance) in A, killed (fact) in B"]
    assert result.moves[0][1] == "check a.one" and result.moves[0][0] > 5


def test_main_names_an_unreadable_report(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(BASE))
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert report_diff.main([str(good), str(bad)]) == 2
    assert f"{bad}: not a parity report" in capsys.readouterr().err
    assert report_diff.main([str(good), str(good)]) == 0


def test_markdown_for_a_pull_request_names_the_flipped_verdicts_the_moves_and_pictures_both(tmp_path):
    from tests.report_samples import flipped, sample

    base, head, out = tmp_path / "main.json", tmp_path / "pr.json", tmp_path / "changes" / "summary.md"
    base.write_text(json.dumps(sample()))
    head.write_text(json.dumps(flipped()))
    assert report_diff.main([str(base), str(head), "--md", str(out), "--html", str(tmp_path / "changes.html")]) == 1
    markdown = out.read_text()
    changed = markdown.split("## Verdicts that changed (2)", 1)[1].split("## Largest margin moves", 1)[0]
    assert "| check ar.fake.unequal_real_pos.logp | PASS | FAIL |" in changed
    assert "| ablation replay.sigma_scalar -> replay.cfg2.log_probs | killed (tolerance) | NOT killed (tolerance) |" \
        in changed
    moves = markdown.split("## Largest margin moves", 1)[1].split("## Margins of both", 1)[0]
    assert "| check replay.sd3.growth.prev_sample_means | 0.5 | 0.05 | 1.00 |" in moves
    assert "bars base (4), line head (4)" in markdown and markdown.count("```mermaid") == 4
    assert "<summary>base, as text</summary>" in markdown and "<summary>head, as text</summary>" in markdown
    page = (tmp_path / "changes.html").read_text()
    assert "2 verdicts changed" in page and "ar.fake.unequal_real_pos.logp" in page
    same = tmp_path / "same.md"
    assert report_diff.main([str(base), str(base), "--md", str(same)]) == 0
    assert "## Verdicts that changed: none" in same.read_text() and "No margin moved." in same.read_text()
