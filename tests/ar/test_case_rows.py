"""The AR PR's report (docs/contracts.md), regenerated: each ar ablation on its cases, per model, in its own shape.

Every row judges the four case quantities (tokens exact, log-probs, prefill KV, slot 0) plus the path spy. A
row fails exactly when its ablation claims that case on that model, so the survivors the ablations' ``why``
texts explain (tail-append on the hole layout, a zero pad of transformers' positions) are pinned down too.
With ``-v`` the table is printed (capture off): the CPU tier's rendition of the AR PR's harness log.
"""

from __future__ import annotations

import functools

import pytest

from fixtures import ar_models
from fixtures.ar_cases import CASES
from harness.ar import comparisons, judge, loop
from harness.ar.spy import ARForwardSpy
from harness.judging import ablation, catalogue
from parity import ar_checks

pytestmark = pytest.mark.cpu

catalogue.load()
TABLE_CASES = tuple(c for c in CASES if c.name in ("unequal_real_pos", "concat"))


@functools.cache
def _reference(model: str, case_name: str) -> loop.Rollout:
    case = next(c for c in TABLE_CASES if c.name == case_name)
    return loop.stock_rollout(ar_models.backend(model), case.prompts(), case.max_new_tokens)


def _row(model: str, case, label: str, fresh_reference: bool = False) -> tuple[bool, str]:
    """One table row; ``fresh_reference`` recomputes the stock run (under an applied ablation: a seam stock code
    also runs through, such as ``loop.token_logprob``, then moves both sides, as it would in the check)."""
    backend = ar_models.backend(model)
    reference = (loop.stock_rollout(backend, case.prompts(), case.max_new_tokens) if fresh_reference
                 else _reference(model, case.name))
    policies = ar_checks._policies(model, case)
    try:
        with ARForwardSpy(backend.model) as spy:
            fast = loop.fast_rollout(backend, case.batch(), case.max_new_tokens)
    except AssertionError as err:
        return False, judge.format_case_row(label, False, raised=f"AssertionError {err}".strip())
    passed, violated = True, []
    for what in comparisons.CASE_QUANTITIES:
        verdict = judge.compare_case(what, fast, reference, policies)
        verdict = judge.require_path(verdict, spy, case.batch_size)
        passed &= verdict.passed
        violated += [n for n in verdict.notes if n.startswith("VIOLATED") and n not in violated]
    return passed, judge.format_case_row(label, passed, judge.case_row_metrics(fast, reference),
                                           note="; ".join(violated))


@pytest.mark.parametrize("model", ar_models.BACKENDS)
def test_every_case_row_fails_exactly_where_its_ablation_claims(model: str, capsys: pytest.CaptureFixture,
                                                                request: pytest.FixtureRequest) -> None:
    lines, wrong = [], []
    for case in TABLE_CASES:
        real_pos = case.batch().real_pos.flatten().tolist()
        lines.append(f"=== {model}: {case.name} ({case.construction}, real_pos={real_pos}, "
                     f"{case.decode_steps} decode steps) vs independent B=1 ===")
        passed, text = _row(model, case, "batched right-padded AR")
        lines.append(text)
        if not passed:
            wrong.append("the unablated batched path")
        for item in ablation.all_ablations(path="ar"):
            claimed = any(k.startswith(f"ar.{model}.{case.name}.") for k in item.kills)
            with item.apply():
                passed, text = _row(model, case, f"{item.name} -> expect {'FAIL' if claimed else 'PASS'}",
                                    fresh_reference=True)
            lines.append(text)
            if passed == claimed:
                wrong.append(f"{item.name} on {case.name}")
    table = "\n".join(lines)
    if request.config.get_verbosity() > 0:
        with capsys.disabled():
            print("\n" + table)
    assert not wrong, f"rows not as claimed: {wrong}\n{table}"
