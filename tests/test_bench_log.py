"""The benchmark tables: rows merged per case, ratios, the report's ``benchmarks`` section, and a bench run that
prints only what ``-k`` selected, without ``-s``."""

from __future__ import annotations

import json

import pytest

from harness.reports import report
from harness.reports.bench import BenchLog

pytestmark = pytest.mark.cpu


def test_rows_merge_per_case_and_give_every_ratio() -> None:
    log = BenchLog()
    assert not log
    log.record("ar", "ar title", {"model": "m", "B": 4}, ideal=0.25, fast=2.0, stock=8.0)
    row = log.record("ar", "ar title", {"model": "m", "B": 4}, raw=1.6, raw_stock=6.4, extra={"tokens": 64})
    assert log and len(log.tables["ar"].rows) == 1
    assert row.seconds == {"fast": 2.0, "stock": 8.0, "raw": 1.6, "raw_stock": 6.4}
    assert row.ratios() == pytest.approx({"fast_over_stock": 0.25, "ideal": 0.25, "raw_over_stock": 0.25,
                                          "fast_over_raw": 1.25, "vs_raw": 1.0})


def test_without_raw_stock_the_model_ratio_is_over_stock() -> None:
    row = BenchLog().record("decode", "t", {"W": 2}, fast=3.0, stock=4.0, raw=2.0)
    assert row.ratios()["raw_over_stock"] == pytest.approx(0.5)
    assert row.ratios()["vs_raw"] == pytest.approx(0.75 / 0.5)


def test_an_unknown_arm_is_refused_naming_the_arms() -> None:
    with pytest.raises(ValueError, match=r"unknown bench arms \['slow'\]"):
        BenchLog().record("ar", "t", {"B": 4}, slow=1.0)


def test_lines_leave_out_unmeasured_columns_and_mark_missing_cells() -> None:
    log = BenchLog()
    log.record("attention", "kernels", {"kernel": "a"}, fast=0.002, stock=0.004, extra={"pairs": "10"})
    log.record("attention", "kernels", {"kernel": "b"}, fast=0.001)
    title, header, *rows = log.lines()
    assert title == "kernels"
    assert header.split() == ["kernel", "fast", "ms", "stock", "ms", "fast/stock", "pairs"]
    assert rows[0].split() == ["a", "2.00", "4.00", "0.500", "10"]
    assert rows[1].split() == ["b", "1.00", "-", "-", "-"]


def test_the_report_carries_the_benchmarks_section_only_when_measured() -> None:
    assert "benchmarks" not in report.build([], [])
    log = BenchLog()
    log.record("replay", "replay title", {"family": "f", "S": 2}, ideal=0.5, fast=1.0, stock=4.0, raw=float("inf"))
    built = report.build([], [], benchmarks=log.to_json())
    table = built["benchmarks"]["replay"]
    assert table["path"] == "replay" and table["title"] == "replay title"
    row = table["rows"][0]
    assert set(row) == {"case", "fast_s", "stock_s", "raw_s", "raw_stock_s", "ideal", "ratios", "extra"}
    assert row["case"] == {"family": "f", "S": 2} and row["raw_stock_s"] is None and row["raw_s"] == "inf"
    assert set(row["ratios"]) == {"fast_over_stock", "raw_over_stock", "fast_over_raw", "vs_raw"}
    json.dumps(built, allow_nan=False)  # what report.write does


BENCH_MODULE = '''
import pytest

pytestmark = pytest.mark.bench
MEASURED = []


@pytest.fixture(params=["alpha", "beta"])
def model(request):
    return request.param


def test_timed(bench_log, model):
    MEASURED.append(model)
    bench_log.record("demo", "demo title", {"model": model}, ideal=0.5, fast=0.001, stock=0.004, raw=0.0008)
'''


def test_a_bench_run_prints_and_reports_only_what_k_selected(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_demo_bench=BENCH_MODULE)
    result = pytester.runpytest("-p", "harness.plugin", "-m", "bench", "-k", "alpha", "-p", "no:benchmark",
                                "--parity-report=out/parity.json")
    result.assert_outcomes(passed=1, deselected=1)
    result.stdout.fnmatch_lines(["*fastpath-parity benchmarks*", "demo title", "*model*fast ms*fast/raw*",
                                 "*alpha*1.00*4.00*0.80*0.250*0.500*"])
    result.stdout.no_fnmatch_line("*beta*")
    result.stdout.no_fnmatch_line("checks: 0/0*")  # a bench-only run judged nothing: no empty parity table
    data = json.loads((pytester.path / "out/parity.json").read_text())
    assert [row["case"] for row in data["benchmarks"]["demo"]["rows"]] == [{"model": "alpha"}]


def test_bench_rounds_are_a_tables_own_unless_capped_and_a_malformed_cap_names_its_variable(monkeypatch):
    from fixtures.bench_timing import ROUNDS_ENV, bench_rounds

    monkeypatch.delenv(ROUNDS_ENV, raising=False)
    assert bench_rounds(15) == 15
    monkeypatch.setenv(ROUNDS_ENV, "1")
    assert (bench_rounds(15), bench_rounds(3)) == (1, 1)
    monkeypatch.setenv(ROUNDS_ENV, "20")
    assert bench_rounds(15) == 15
    for bad in ("0", "-2", "one"):
        monkeypatch.setenv(ROUNDS_ENV, bad)
        with pytest.raises(ValueError, match=rf"{ROUNDS_ENV}='{bad}': expected a positive integer"):
            bench_rounds(15)
