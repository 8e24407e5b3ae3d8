"""The report's pictures: what each one draws, byte-identical output for the same report, and the text a reader
gets where matplotlib (the report extra) is missing. The browser check is tests/test_report_browser.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from harness.reports import report, report_pictures
from tests.report_samples import sample

pytestmark = pytest.mark.cpu


def test_rows_place_margins_zeros_facts_and_floor_marks():
    rows = {row.label: row for row in report_pictures.check_rows(sample(), "replay")}
    assert set(rows) == {"cfg2.log_probs", "cfg2.replay_determinism", "guard.flag_off",
                         "sd3.growth.prev_sample_means"}
    assert rows["cfg2.log_probs"].where == 0.125 and rows["cfg2.replay_determinism"].where == "0"
    assert rows["guard.flag_off"].where == "none"
    marks = rows["cfg2.log_probs"].marks  # as fractions of the bound the floor set
    assert marks["floor_minimum"] == pytest.approx(4.8e-7 / 1.9e-6)
    assert marks["floor_ceiling"] == pytest.approx(3.3e-5 / 1.9e-6)
    skipped = [row.label for row in report_pictures.check_rows(sample(), "ar")]
    assert "gpu.batched_vs_b1" not in skipped  # a skipped check holds no margin to draw


def test_kills_keep_their_mode_and_growth_pairs_its_curves():
    kills = {row.label: row.kills for row in report_pictures.kill_rows(sample(), "ar")}
    assert kills == {"decode_mask_removed": (("killed", 2.2e5), ("killed", "raises"))}
    curves = report_pictures.growth_curves(sample(), "ar")
    assert [c.label for c in curves] == ["fake.growth.logp"] and len(curves[0].fast) == len(curves[0].stock) == 6


def test_the_text_pictures_bar_each_margin_against_the_tolerance():
    text = report_pictures.text_section(sample())
    line = next(x for x in text.splitlines() if "cfg2.log_probs" in x)
    bar = line.split("cfg2.log_probs", 1)[1]
    assert "#" in bar and "|" in bar and "!" not in bar and "1.25e-01 PASS" in line
    assert "fast vs stock   [" in text and "stock control   [" in text
    assert "sigma_scalar" in text and "inf" in text and "fact" in text


def test_the_markdown_report_carries_charts_github_draws_and_their_text():
    markdown = report.render_markdown(sample())
    assert markdown.index("## Pictures") < markdown.index("## Parity checks")
    assert markdown.count("```mermaid") == 6  # per path: checks and kills; and one growth chart each
    assert "xychart-beta" in markdown and "<details><summary>the same as text</summary>" in markdown
    assert "data:" not in markdown and "<svg" not in markdown  # GitHub's sanitizer strips both


@pytest.fixture(scope="module")
def drawn() -> dict[str, str]:
    pytest.importorskip("matplotlib")
    return report_pictures.svgs(sample())


def test_svg_pictures_are_byte_identical_for_the_same_report(drawn):
    assert list(drawn) == ["margins-replay.svg", "kills-replay.svg", "growth-replay.svg", "margins-ar.svg",
                           "kills-ar.svg", "growth-ar.svg"]
    assert report_pictures.svgs(sample()) == drawn
    svg = drawn["margins-replay.svg"]
    assert svg.startswith("<?xml") and "<dc:date>" not in svg and "cfg2.log_probs" in svg


def test_pictures_split_with_a_helper_are_the_same_bytes_and_a_failed_helper_changes_nothing(drawn, monkeypatch):
    """A report that takes seconds to draw is split with a helper interpreter; were it to fail, its half is drawn
    here. Either way every picture is the one drawn in one process."""
    monkeypatch.setattr(report_pictures, "SPLIT_ABOVE_S", 0.0)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    helpers = []
    popen = subprocess.Popen

    def spawned(*args, **kwargs):
        helpers.append(popen(*args, **kwargs))
        return helpers[-1]

    monkeypatch.setattr(subprocess, "Popen", spawned)
    assert report_pictures.svgs(sample()) == drawn
    assert [h.returncode for h in helpers] == [0]
    monkeypatch.setattr(sys, "executable", shutil.which("false"))  # a helper that fails at once
    monkeypatch.setattr(report_pictures, "_draw", lambda kind, args: f"{kind} of {args[0]}")  # drawn here
    assert report_pictures.svgs(sample()) == {name: "{} of {}".format(*name[:-4].split("-")) for name in drawn}
    assert [h.returncode for h in helpers] == [0, 1]


def test_a_helper_that_overruns_its_time_leaves_its_half_to_this_process():
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        assert report_pictures._helped(helper, timeout=0.2) == {}
    finally:
        helper.kill()
        helper.wait()
        helper.stdout.close()


def test_the_html_report_stands_alone_and_falls_back_to_text(drawn, tmp_path, monkeypatch):
    monkeypatch.setattr(report_pictures, "svgs", lambda data: drawn)  # drawn once for this module
    written = report.write(sample(), tmp_path / "parity.html").read_text()
    assert written.count('<img alt="') == 6 and 'src="data:image/svg+xml;base64,' in written
    assert "<pre>" not in written and "replay.cfg2.log_probs" in written  # the tables follow the pictures
    monkeypatch.undo()
    monkeypatch.setattr(report_pictures, "available", lambda: False)
    plain = report.render_html(sample())
    assert "<img" not in plain and "<pre>" in plain and "matplotlib, the report extra, is not installed" in plain
