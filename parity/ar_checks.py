"""Parity checks of the ar path (registered into harness.judging.checks).

For the fake HunyuanImage-3 upstream and for each tiny transformers model (HunYuanMoEV1, Qwen3):
- ``ar.<model>.<case>.{tokens,logp,prefill_kv,slot0}`` on the AR PR's cases and the AR issue's concat construction
  (docs/contracts.md);
- ``ar.<model>.padded_b1.equals_unpadded``, ``.rollout_vs_replay``, ``.finished_rows``, ``.nan_unused_slots``;
- ``ar.<model>.growth.logp``: the per-step error curve over 16 steps, its growth against the stock floor curve's;
and ``ar.missing_real_pos.{b1,b4}``. fp32 tolerances are TOLERANCE_K x the stock floor measured on the same model.
B=1 references, the floors and the models are seam-free and cached; every batched rollout runs inside its check
(so an applied ablation always reaches it).

Every rollout is given EOS ids, so every one meets a finished row (a rollout without EOS would let an
implementation that keeps sampling or writing KV for finished rows pass): ``finished_rows`` stops two rows early
against a stock B=1 run given the same EOS ids; every other case stops one row near its middle
(``fixtures.ar_cases.eos_for_one_stop``), against its un-stopped stock reference cut at that EOS.
"""

from __future__ import annotations

import functools

import torch

from fixtures import ar_models
from fixtures.ar_cases import CASES, EXTRA, ARCase, eos_for_one_stop, eos_for_stops, stopped_at_eos
from harness.ar import comparisons, judge, loop
from harness.ar import policies as ar_policies
from harness.judging import floors, space
from harness.judging.checkid import CheckId
from harness.judging.checks import register
from harness.judging.compare import Verdict, close
from harness.judging.floors import module_reduction_terms
from harness.plugins import conformance

MODELS = ar_models.BACKENDS
FINISHED_STOPS = {0: 1, 2: 3}  # row -> decode step whose reference token becomes an EOS id
FIRST_TOKEN_STOPS = {1: 0}  # row 1's first token, the one sampled from the prefill's logits, becomes an EOS id
# fp32 log_softmax against fp64: the rounding of a log-sum-exp and one subtraction, a few ulps of the largest logit
ORACLE_ULPS = 16.0
# 16 tokens (15 decode steps) on four unequal right-padded rows: enough steps for thirds of five
GROWTH_CASE = ARCase("growth", (9, 17, 13, 21), decode_steps=15, seed=25)


@functools.cache
def _floor(model: str, case: ARCase) -> ar_policies.StockPrefillFloor:
    """The stock prefill floor at the case's own shape: its row count and padded width."""
    return ar_policies.stock_prefill_floor(ar_models.backend(model), rows=case.batch_size, length=case.batch().width)


@functools.cache
def _reference(model: str, case: ARCase, attn: str = "sdpa", eos: tuple[int, ...] = ()) -> loop.Rollout:
    return loop.stock_rollout(ar_models.backend(model, attn), case.prompts(), case.max_new_tokens, eos)


@functools.cache
def _eos(model: str, case: ARCase, attn: str = "sdpa") -> tuple[int, ...]:
    """The EOS id every rollout of ``case`` gets: it stops one row near the middle."""
    eos = eos_for_one_stop(_reference(model, case, attn).tokens)
    if not eos:
        raise ValueError(f"ar case {case.name} on {model}: no token stops exactly one row early; pick another seed")
    return eos


@functools.cache
def _stopped(model: str, case: ARCase, attn: str = "sdpa") -> loop.Rollout:
    """The stock B=1 reference of ``case`` stopped at its EOS id."""
    return stopped_at_eos(_reference(model, case, attn), _eos(model, case, attn), ar_models.backend(model).pad_id)


def _policies(model: str, case: ARCase) -> ar_policies.ARPolicies:
    unpadded_b1 = case.batch_size == 1 and (case.width is None or case.width == case.lengths[0])
    if model == "fake" and unpadded_b1:
        return ar_policies.exact_policies()
    return ar_policies.fp32_policies(_floor(model, case))


@functools.cache
def _finished_eos(model: str) -> tuple[int, ...]:
    eos, _ = eos_for_stops(_reference(model, EXTRA["finished_rows"]).tokens, FINISHED_STOPS)
    return eos


@functools.cache
def _first_token_eos(model: str) -> tuple[int, ...]:
    eos, lengths = eos_for_stops(_reference(model, EXTRA["finished_rows"]).tokens, FIRST_TOKEN_STOPS)
    if lengths[1] != 1 or max(lengths) == 1:
        raise ValueError(f"ar first-token EOS on {model}: lengths {lengths}; row 1 must stop at its first token "
                         "while another row goes on (pick another seed)")
    return eos


def _first_token_finished(model: str) -> Verdict:
    """Row 1 emits EOS as its very first token (the prefill's pick): it stops there, the others go on."""
    case = EXTRA["finished_rows"]
    eos = _first_token_eos(model)
    return comparisons.compare_finished_rows(ar_models.backend(model), case.batch(), case.max_new_tokens, eos,
                                             _policies(model, case), _reference(model, case, eos=eos))


def _case_check(model: str, case: ARCase, what: str) -> Verdict:
    return comparisons.compare_batched(what, ar_models.backend(model), case.batch(),
                                 case.max_new_tokens, _policies(model, case), _stopped(model, case),
                                 _eos(model, case))


def _padded_b1(model: str) -> Verdict:
    case = EXTRA["padded_b1"]
    return comparisons.compare_padded_b1(ar_models.backend(model), case.batch(),
                                   case.max_new_tokens, _policies(model, case), _stopped(model, case),
                                   _eos(model, case))


def _rollout_vs_replay(model: str) -> Verdict:
    case = EXTRA["rollout_vs_replay"]
    floor = _floor(model, case)
    atol = ar_policies.fp32_tolerance(floor, "logp")
    policy = close(atol=atol, rtol=0.0, reason=(
        f"fp32: cached batched decode vs one cache-free unpadded forward per row; {ar_policies.TOLERANCE_K:g} x "
        f"{floor.describe('logp')}"))
    verdict = comparisons.compare_rollout_vs_replay(ar_models.backend(model),
                                              case.batch(), case.max_new_tokens, policy, _eos(model, case))
    return judge.require_floor_bounds(verdict, atol, floor, "logp")


def _finished_rows(model: str) -> Verdict:
    case = EXTRA["finished_rows"]
    eos = _finished_eos(model)
    return comparisons.compare_finished_rows(ar_models.backend(model), case.batch(),
                                       case.max_new_tokens, eos, _policies(model, case),
                                       _reference(model, case, eos=eos))


def _nan_unused_slots(model: str) -> Verdict:
    case = EXTRA["nan_unused_slots"]
    return comparisons.compare_nan_unused_slots(ar_models.backend(model, "read_safe"),
                                          case.batch(), case.max_new_tokens, _policies(model, case),
                                          _stopped(model, case, "read_safe"), _eos(model, case, "read_safe"))


def _oracle(model: str) -> Verdict:
    case = EXTRA["rollout_vs_replay"]
    scale = float(_reference(model, case).logits.abs().max())
    policy = close(atol=ORACLE_ULPS * ar_policies.FP32_EPS * scale, rtol=0.0, reason=(
        f"fp32 log_softmax vs fp64 over the same logits: {ORACLE_ULPS:g} fp32 ulps of the stock run's max |logit| "
        f"{scale:.3g} (a log-prob is a logit minus a log-sum-exp of that size)"))
    return comparisons.check_greedy_logp_oracle(ar_models.backend(model), case.batch(),
                                          case.max_new_tokens, policy, _eos(model, case))


@functools.cache
def _growth_control(model: str) -> torch.Tensor:
    """The stock per-step floor's log-probs: each prompt right-padded in every row of a batch of the growth case's
    row count and width, in the batch's cache (stock code at the fast path's shape)."""
    case, batch = GROWTH_CASE, GROWTH_CASE.batch()
    return judge.batch_shape_control_logp(ar_models.backend(model), case.prompts(), _stopped(model, case),
                                             batch.width, batch.width + case.max_new_tokens)


def _growth_terms(model: str, width: int) -> int:
    """The reduction terms one log-prob of the growth case accumulates (the control's ceiling)."""
    backend = ar_models.backend(model)
    return module_reduction_terms(backend.model, sequence=width + GROWTH_CASE.max_new_tokens) + backend.vocab_size


def _growth(model: str) -> Verdict:
    case, batch = GROWTH_CASE, GROWTH_CASE.batch()
    return comparisons.compare_growth(ar_models.backend(model), batch, case.max_new_tokens, _eos(model, case),
                                      _stopped(model, case), _growth_control(model), _growth_terms(model, batch.width))


def _missing_real_pos(case: ARCase) -> Verdict:
    return comparisons.check_missing_real_pos(ar_models.backend("fake"),
                                        case.batch(), case.max_new_tokens, eos=(1,))


FP32_POLICY = (f"tokens exact; fp32 quantities close within {ar_policies.TOLERANCE_K:g} x the stock prefill floor at "
               f"the case's shape (bounded to [{ar_policies.K_MIN:g}, {ar_policies.K_MAX:g}] x it); exact on the "
               "fake's unpadded B=1")
ORACLE_POLICY = f"close(atol={ORACLE_ULPS:g} fp32 ulps of the stock run's max |logit|) against an fp64 log_softmax"
GROWTH_POLICY = (f"per-step error growth <= {judge.GROWTH_BUDGET:g} x the stock floor curve's growth "
                 "(harness.judging.growth)")

for _model in MODELS:
    for _case in CASES:
        for _what in comparisons.CASE_QUANTITIES:
            register(CheckId("ar", _model, _case.name, _what), policy=FP32_POLICY,
                     doc=f"{_what} of the batched {_case.name} rollout vs per-row B=1 on {_model}")(
                functools.partial(_case_check, _model, _case, _what))
    register(CheckId("ar", _model, "padded_b1", "equals_unpadded"), policy=FP32_POLICY,
             doc=f"a right-padded B=1 prompt equals the unpadded prompt on {_model}")(
        functools.partial(_padded_b1, _model))
    register(CheckId("ar", _model, "", "rollout_vs_replay"), policy=FP32_POLICY,
             doc=f"batched rollout log-probs equal teacher-forced replay on {_model}")(
        functools.partial(_rollout_vs_replay, _model))
    register(CheckId("ar", _model, "", "finished_rows"), policy=FP32_POLICY,
             doc=f"rows past EOS stop sampling and writing KV, equal B=1 stopped at EOS, on {_model}")(
        functools.partial(_finished_rows, _model))
    register(CheckId("ar", _model, "first_token_eos", "finished_rows"), policy=FP32_POLICY,
             doc=f"a row whose first sampled token is EOS stops there while the others go on, on {_model}")(
        functools.partial(_first_token_finished, _model))
    register(CheckId("ar", _model, "oracle", "greedy_logp"), policy=ORACLE_POLICY,
             doc=f"greedy picks and recorded log-probs of both rollouts equal an fp64 softmax, on {_model}")(
        functools.partial(_oracle, _model))
    register(CheckId("ar", _model, "growth", "logp"), policy=GROWTH_POLICY,
             doc=f"per-step logp error of a 16-token batched rollout grows no faster than the stock floor, {_model}")(
        functools.partial(_growth, _model))
    register(CheckId("ar", _model, "", "nan_unused_slots"), policy=FP32_POLICY,
             doc=f"NaN in unused and dead cache slots never reaches an output on {_model}")(
        functools.partial(_nan_unused_slots, _model))

for _case in (ARCase("missing_b1", (9,), decode_steps=2, seed=31), ARCase("missing_b4", (9, 4, 7, 5), 2, seed=32)):
    register(CheckId("ar", "", "missing_real_pos", f"b{_case.batch_size}"),
             policy="fact: init_state raises ValueError naming real_pos",
             doc=f"init_state raises ValueError naming real_pos when it is missing at B={_case.batch_size}")(
        functools.partial(_missing_real_pos, _case))

# the right-padded layout's checks (every ar check the left-padded catalogue does not claim more specifically)
conformance.judges_layout("ar.*", "ar", "right")
# where each check sits in the ar input space (harness.judging.space): the model it rolls out and the padding side
space.at("ar.*", padding_side="right")
space.at("ar.missing_real_pos.*", model="fake")
for _model in MODELS:
    space.at(f"ar.{_model}.*", model=_model)

_AR_CEILING = ("8 sqrt(K) fp32 ulps of the same magnitude, K = the model's Linear fan-ins plus the keys plus the "
               "vocabulary's log-sum-exp")
floors.declare("ar.*", "1 fp32 ulp of the compared values' magnitude (max |log-prob|, max |KV|)", _AR_CEILING)
floors.declare("ar.*.growth.logp", "1 fp32 ulp of each step's mean |log-prob|", _AR_CEILING)
floors.declare("ar.gpu.*", "fp32: 1 fp32 ulp of max |log-prob|; bf16: 1 bf16 ulp of max |log-prob| (dtype control)",
               "8 sqrt(K) ulps of the dtype, K = the model's Linear fan-ins plus the keys plus the vocabulary")
