"""A Verdict's own behaviour: the rendered report, merging, bounds on a tolerance and boolean facts."""

import math

import pytest

from harness.judging.compare import UNSTAMPED, Verdict, holds, raises

pytestmark = pytest.mark.cpu


def test_describe_renders_status_message_metrics_notes_and_margin():
    failed = Verdict("replay.cfg2.log_probs", False,
                     {"zero": 0.0, "big": math.inf, "nan": math.nan, "x": 1.5, "rows": 3, "per_row": [1, 2],
                      "by_rank": {"0": 1}},
                     "exact (bitwise)", math.inf, message="output: boom",
                     notes=("ok: one forward", "VIOLATED: batch of 4 rows"))
    assert failed.describe() == (
        "FAIL replay.cfg2.log_probs under exact (bitwise)\n"
        "output: boom\n"
        "metrics: zero=0.0, big=inf, nan=nan, x=1.500e+00, rows=3\n"
        "ok: one forward\n"
        "VIOLATED: batch of 4 rows\n"
        "margin (error / tolerance): inf")
    passed = Verdict("ar.greedy.tokens", True, {"m": -2.5e-7}, "ulp(2)", 0.5)
    assert passed.describe() == ("PASS ar.greedy.tokens under ulp(2)\nmetrics: m=-2.500e-07\n"
                                 "margin (error / tolerance): 5.000e-01")
    bare = Verdict("decode.t37.fact", True, {}, "fact: x", None)
    assert bare.describe() == "PASS decode.t37.fact under fact: x"


def test_path_and_headline_value():
    v = Verdict("decode.t37.w8.bitexact", True, {"max_abs": 0.25, "max_ulp": 3}, "p", 0.0, headline="max_ulp")
    assert (v.path, v.headline_value) == ("decode", 3)
    no_headline = Verdict("attention", True, {"max_abs": 0.25}, "p", None)
    assert (no_headline.path, no_headline.headline_value) == ("attention", None)


def test_with_metrics_attaches_without_a_fact():
    v = Verdict("t.m", False, {"a": 1}, "p", 2.0, message="m", notes=("VIOLATED: f",))
    assert v.with_metrics(a=3, floor=1e-6) == Verdict("t.m", False, {"a": 3, "floor": 1e-6}, "p", 2.0, message="m",
                                                      notes=("VIOLATED: f",))


def test_merge_keeps_the_first_lead_on_a_tied_margin_and_joins_policies():
    first = Verdict("r.c.w", True, {"a": 1}, "p", 0.5, headline="a", tolerance=0.1, message="m1", notes=("ok: f1",))
    second = Verdict("r.c.w", False, {"b": 2}, "q", 0.5, headline="b", tolerance=2.0, message="m2",
                     notes=("VIOLATED: f2",))
    assert first.merge(second) == Verdict("r.c.w", False, {"a": 1, "b": 2}, "p; q", 0.5, headline="a",
                                          tolerance=0.1, message="m1\nm2", notes=("ok: f1", "VIOLATED: f2"))
    larger = Verdict("r.c.w", True, {"b": 2}, "p", 0.75, headline="b", tolerance=2.0)
    assert first.merge(larger) == Verdict("r.c.w", True, {"a": 1, "b": 2}, "p", 0.75, headline="b",
                                          tolerance=2.0, message="m1", notes=("ok: f1",))
    fact = holds(True, "one forward")
    assert fact.merge(first).margin == 0.5 and first.merge(fact).headline == "a"


def test_require_bounded_accepts_both_edges_and_rejects_just_outside():
    base = Verdict("t.bound", True, {}, "p", 0.0)
    for tolerance in (0.5, 2.0):  # exactly k_min x floor and exactly k_max x floor
        edge = base.require_bounded(tolerance, 0.25, k_min=2, k_max=8, what="logp tolerance")
        fact = "logp tolerance within [2, 8] x the stock floor 2.500e-01"
        assert edge == Verdict("t.bound", True, {"stock_floor": 0.25, "tolerance_bound": tolerance}, "p", 0.0,
                               notes=(f"ok: {fact}",))
    tight = base.require_bounded(math.nextafter(0.5, 0), 0.25, k_min=2, k_max=8)
    assert tight.violated_facts == ["tolerance 5.000e-01 is too tight: below 2 x the stock floor 2.500e-01 = 5.000e-01"]
    loose = base.require_bounded(math.nextafter(2.0, 3), 0.25, k_min=2, k_max=8)
    assert loose.violated_facts == ["tolerance 2.000e+00 is too loose: above 8 x the stock floor 2.500e-01 = 2.000e+00"]
    assert not tight.passed and not loose.passed


def test_holds_and_raises_report_what_was_observed():
    assert holds(True, "one forward", forwards=1) == Verdict(
        UNSTAMPED, True, {"forwards": 1}, "fact: one forward", None, notes=("ok: one forward",))
    assert holds(False, "one forward", forwards=2, share=0.5).message == (
        "expected: one forward; observed: forwards=2, share=5.000e-01")
    assert holds(False, "one forward").message == "expected: one forward; observed: it does not hold"
    long = "x" * 301

    def raise_value_error():
        raise ValueError(long)

    def raise_key_error():
        raise KeyError(long)

    raised = raises(raise_value_error, ValueError, match="x+")
    assert raised.passed and raised.metrics == {"raised": "ValueError", "error": "x" * 300}
    assert raised.policy == "fact: raises ValueError matching 'x+'"
    unmatched = raises(raise_value_error, (KeyError, ValueError), match="y")
    assert not unmatched.passed and unmatched.policy == "fact: raises KeyError/ValueError matching 'y'"
    silent = raises(lambda: None, ValueError)
    assert (silent.passed, silent.metrics, silent.message) == (
        False, {"raised": "nothing"}, "expected: raises ValueError; observed: raised=nothing")
    any_text = raises(raise_value_error, ValueError)
    assert any_text.passed and any_text.policy == "fact: raises ValueError"
    wrong = raises(raise_key_error, ValueError)
    assert not wrong.passed and wrong.metrics == {"raised": "KeyError", "error": "'" + "x" * 299}


def test_a_merged_verdict_heads_with_its_leading_part_s_own_number() -> None:
    """Parts that measure the same metric name must not lend the failing one a passing part's number."""
    import torch

    from harness.judging.compare import close

    failing = close(atol=1e-3, rtol=0.0).judge(torch.tensor([1.0]), torch.tensor([0.0]), what="failing")
    passing = close(atol=1e-3, rtol=0.0).judge(torch.tensor([0.0]), torch.tensor([0.0]), what="passing")
    merged = failing.merge(passing)
    assert not merged.passed and merged.headline == "max_abs" and merged.headline_value == 1.0
    assert passing.merge(failing).headline_value == 1.0


def test_a_leading_headline_that_names_no_metric_of_its_own_merges_without_one() -> None:
    """A verdict may name a table column it holds no number for (headline_value None); merged, it stays so."""
    named = Verdict("t.head", True, {}, "p", 0.5, headline="max_abs")
    merged = named.merge(Verdict("t.head", True, {"other": 1}, "q", None))
    assert (merged.headline, merged.headline_value, merged.metrics) == ("max_abs", None, {"other": 1})


def test_a_failed_verdict_whose_error_sits_exactly_at_its_tolerance_names_the_fact_that_failed_it():
    """Margin 1 passes the numbers (error <= tolerance), so the failure must have been a fact: it is named."""
    at_bound = Verdict("t.edge", False, {}, "p", 1.0, notes=("VIOLATED: one forward",))
    assert at_bound.describe().endswith("margin (error / tolerance): 1.000e+00 (the numbers pass; fact failed: "
                                        "one forward)")
    over = Verdict("t.edge", False, {}, "p", 1.5, notes=("VIOLATED: one forward",))
    assert over.describe().endswith("margin (error / tolerance): 1.500e+00")
