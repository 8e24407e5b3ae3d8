"""Parity checks of the ar path's left-padded layout (registered into harness.judging.checks).

A left-padded batch of a case holds the case's own prompts at the case's own width, so these checks share the
right-padded catalogue's cached B=1 references, EOS ids, stock floors, policies and growth control
(``parity.ar_checks``) and its comparisons (``harness.ar.comparisons``); only the batch and the rollout under test
differ. For the fake HunyuanImage-3 upstream and each tiny transformers model:

- ``ar.<model>.left.<case>.{tokens,logp,prefill_kv}`` on unequal, skewed and all-padded rows;
- ``ar.<model>.left.padded_b1.equals_unpadded``: one left-padded row (B=1 keeps the dynamic cache);
- ``ar.<model>.left.finished_rows`` (two rows stop at EOS, the cache footprint checked),
  ``ar.<model>.left.nan_unused_slots`` (NaN in every pad and unused slot), ``ar.<model>.left.oracle.greedy_logp``
  (the fp64 oracle of the recorded log-probs) and ``ar.<model>.left.growth.logp`` (16 tokens; the stock floor curve
  runs the batch's row count, width and cache length, as for the right-padded layout: stock code has no
  left-padded path, and the rounding a batch shape brings is the same GEMMs' and key axis').

Every verdict also requires the model's prefill rows to have been left-padded (``judge.require_layout``). Under
``--impl ar=...`` these checks judge the implementations declaring ``padding_side = "left"``.
"""

from __future__ import annotations

import functools

from fixtures import ar_models
from fixtures.ar_cases import CASES, EXTRA, ARCase
from fixtures.ar_models import PAD_ID
from harness.ar import comparisons
from harness.ar import policies as ar_policies
from harness.ar.left_padded import LeftPaddedBatch, left_padded_batch
from harness.judging import space
from harness.judging.checkid import CheckId
from harness.judging.checks import register
from harness.judging.compare import Verdict, close
from harness.plugins import conformance
from parity import ar_checks

MODELS = ar_models.BACKENDS
LEFT = "left"
CASE_NAMES = ("unequal_real_pos", "length_skew", "all_padded")
LEFT_CASES = tuple(case for case in CASES if case.name in CASE_NAMES)
QUANTITIES = ("tokens", "logp", "prefill_kv")


def left_batch(case: ARCase) -> LeftPaddedBatch:
    """The case's prompts left-padded to the case's width (its right-padded batch's)."""
    return left_padded_batch(case.prompts(), PAD_ID, width=case.width)


def _case_check(model: str, case: ARCase, what: str) -> Verdict:
    return comparisons.compare_batched(what, ar_models.backend(model), left_batch(case), case.max_new_tokens,
                                       ar_checks._policies(model, case), ar_checks._stopped(model, case),
                                       ar_checks._eos(model, case))


def _padded_b1(model: str) -> Verdict:
    case = EXTRA["padded_b1"]
    return comparisons.compare_padded_b1(ar_models.backend(model), left_batch(case), case.max_new_tokens,
                                         ar_checks._policies(model, case), ar_checks._stopped(model, case),
                                         ar_checks._eos(model, case))


def _finished_rows(model: str) -> Verdict:
    case = EXTRA["finished_rows"]
    eos = ar_checks._finished_eos(model)
    return comparisons.compare_finished_rows(ar_models.backend(model), left_batch(case), case.max_new_tokens, eos,
                                             ar_checks._policies(model, case),
                                             ar_checks._reference(model, case, eos=eos))


def _nan_unused_slots(model: str) -> Verdict:
    case = EXTRA["nan_unused_slots"]
    return comparisons.compare_nan_unused_slots(ar_models.backend(model, "read_safe"), left_batch(case),
                                                case.max_new_tokens, ar_checks._policies(model, case),
                                                ar_checks._stopped(model, case, "read_safe"),
                                                ar_checks._eos(model, case, "read_safe"))


def _oracle(model: str) -> Verdict:
    case = EXTRA["rollout_vs_replay"]
    scale = float(ar_checks._reference(model, case).logits.abs().max())
    policy = close(atol=ar_checks.ORACLE_ULPS * ar_policies.FP32_EPS * scale, rtol=0.0, reason=(
        f"fp32 log_softmax vs fp64 over the same logits: {ar_checks.ORACLE_ULPS:g} fp32 ulps of the stock run's max "
        f"|logit| {scale:.3g}"))
    return comparisons.check_greedy_logp_oracle(ar_models.backend(model), left_batch(case), case.max_new_tokens,
                                                policy, ar_checks._eos(model, case))


def _growth(model: str) -> Verdict:
    case = ar_checks.GROWTH_CASE
    batch = left_batch(case)
    return comparisons.compare_growth(ar_models.backend(model), batch, case.max_new_tokens,
                                      ar_checks._eos(model, case), ar_checks._stopped(model, case),
                                      ar_checks._growth_control(model), ar_checks._growth_terms(model, batch.width))


def check_ids(models: tuple[str, ...] = MODELS) -> dict[str, list[CheckId]]:
    """Every left-padded check id by kind (``case``, ``padded_b1``, ``finished_rows``, ``nan_unused_slots``,
    ``oracle``, ``growth``): what the ablation catalogue claims from."""
    return {
        "case": CheckId.grid("ar", models, [f"{LEFT}.{c.name}" for c in LEFT_CASES], QUANTITIES),
        "padded_b1": CheckId.grid("ar", models, [f"{LEFT}.padded_b1"], ["equals_unpadded"]),
        "finished_rows": CheckId.grid("ar", models, [LEFT], ["finished_rows"]),
        "nan_unused_slots": CheckId.grid("ar", models, [LEFT], ["nan_unused_slots"]),
        "oracle": CheckId.grid("ar", models, [f"{LEFT}.oracle"], ["greedy_logp"]),
        "growth": CheckId.grid("ar", models, [f"{LEFT}.growth"], ["logp"]),
    }


for _model in MODELS:
    for _case in LEFT_CASES:
        for _what in QUANTITIES:
            register(CheckId("ar", _model, f"{LEFT}.{_case.name}", _what), policy=ar_checks.FP32_POLICY,
                     doc=f"{_what} of the batched left-padded {_case.name} rollout vs per-row B=1 on {_model}")(
                functools.partial(_case_check, _model, _case, _what))
    register(CheckId("ar", _model, f"{LEFT}.padded_b1", "equals_unpadded"), policy=ar_checks.FP32_POLICY,
             doc=f"a left-padded B=1 prompt equals the unpadded prompt on {_model}")(
        functools.partial(_padded_b1, _model))
    register(CheckId("ar", _model, LEFT, "finished_rows"), policy=ar_checks.FP32_POLICY,
             doc=f"left-padded rows past EOS stop sampling and writing KV, equal B=1 stopped at EOS, on {_model}")(
        functools.partial(_finished_rows, _model))
    register(CheckId("ar", _model, LEFT, "nan_unused_slots"), policy=ar_checks.FP32_POLICY,
             doc=f"NaN in the pads' and unused cache slots never reaches a left-padded output on {_model}")(
        functools.partial(_nan_unused_slots, _model))
    register(CheckId("ar", _model, f"{LEFT}.oracle", "greedy_logp"), policy=ar_checks.ORACLE_POLICY,
             doc=f"greedy picks and recorded log-probs of the left-padded and B=1 rollouts equal an fp64 softmax, "
                 f"on {_model}")(functools.partial(_oracle, _model))
    register(CheckId("ar", _model, f"{LEFT}.growth", "logp"), policy=ar_checks.GROWTH_POLICY,
             doc=f"per-step logp error of a 16-token left-padded rollout grows no faster than the stock floor, "
                 f"{_model}")(functools.partial(_growth, _model))

conformance.judges_layout(f"ar.*.{LEFT}.*", "ar", "left")
space.at(f"ar.*.{LEFT}.*", padding_side="left")
