"""The ar verdicts on hand-built rollouts: the AR PR's report row, token divergences, path facts, the floor's inputs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from fixtures import ar_models
from harness.ar import judge
from harness.ar import policies as ar_policies
from harness.ar import spy as ar_spy
from harness.ar.loop import Rollout
from harness.ar.spy import ARForwardSpy
from harness.judging.compare import close, exact

pytestmark = pytest.mark.cpu


def _rollout(tokens: list[list[int]], logp: list[list[float]], kv: list[torch.Tensor],
             real_pos: list[int]) -> Rollout:
    t = torch.tensor(tokens)
    return Rollout(t, torch.tensor(logp), torch.zeros(*t.shape, 3), torch.full((t.shape[0],), t.shape[1]),
                   torch.tensor(real_pos), tuple(kv))


def _kv(slots: int, fill: float) -> torch.Tensor:
    """``[layers 1, 2, H 1, slots, hd 2]`` with slot s holding fill + s."""
    return (fill + torch.arange(slots, dtype=torch.float32))[None, None, None, :, None].expand(1, 2, 1, slots, 2)


def _pair() -> tuple[Rollout, Rollout]:
    """Row 0 agrees everywhere; row 1 diverges at step 1; slot 1 of row 0's KV differs, slot 0 never does."""
    ref = _rollout([[5, 6, 7], [5, 6, 7]], [[-0.1, -0.2, -0.3], [-0.1, -0.2, -0.3]],
                   [_kv(4, 0.0), _kv(3, 0.0)], [3, 2])
    fast_kv0 = _kv(4, 0.0).clone()
    fast_kv0[..., 1, :] += 0.5
    fast = _rollout([[5, 6, 7], [5, 9, 7]], [[-0.1, -0.2, -0.3], [-0.1, -0.45, -0.3]],
                    [fast_kv0, _kv(3, 0.0)], [3, 2])
    return fast, ref


def test_case_row_metrics_and_divergences() -> None:
    fast, ref = _pair()
    metrics = judge.case_row_metrics(fast, ref)
    assert metrics == {"tokens_equal": False, "common_prefix": [3, 1], "logp_max_abs": pytest.approx(0.25),
                       "prefill_kv_max_abs": 0.5, "slot0_max_abs": 0.0, "generated_kv_max_abs": 0.0}
    assert judge.divergences(fast.tokens, ref.tokens) == [
        "row 1 diverges at decode step 1: token 9 vs 6 (step 0 is read from the prefill)"]


def _fed_pair() -> tuple[Rollout, Rollout]:
    """Two rows that hold their prompt's and fed tokens' KV: row 0 a 2-token prompt and 3 tokens emitted (2 fed),
    row 1 a 3-token prompt stopped after 2 (1 fed). The fast run's KV differs at row 1's one fed token only."""
    ref = Rollout(torch.tensor([[5, 6, 7], [8, 9, 0]]), torch.zeros(2, 3), torch.zeros(2, 3, 3),
                  torch.tensor([3, 2]), torch.tensor([2, 3]), (_kv(4, 0.0), _kv(4, 10.0)))
    bad = _kv(4, 10.0).clone()
    bad[0, 0, 0, 3, 1] += 0.25
    return Rollout(ref.tokens, ref.logp, ref.logits, ref.lengths, ref.real_pos, (ref.kv[0], bad)), ref


def test_kv_spans_are_the_slots_both_runs_hold_of_each_part() -> None:
    fast, ref = _fed_pair()
    assert judge.kv_spans(fast, ref) == [(2, 4), (3, 4)]
    assert judge.kv_spans(fast, ref, "all") == [(0, 4), (0, 4)]
    assert judge.kv_spans(fast, ref, "all", fed=[1, 0]) == [(0, 3), (0, 3)]
    assert judge.kv_spans(fast, ref, "generated", fed=[0, 5]) == [(2, 2), (3, 4)]
    short = Rollout(ref.tokens, ref.logp, ref.logits, ref.lengths, ref.real_pos, (_kv(3, 0.0), _kv(4, 10.0)))
    assert judge.kv_spans(short, ref) == judge.kv_spans(ref, short) == [(2, 3), (3, 4)]
    with pytest.raises(ValueError, match="'generated' or 'all'"):
        judge.kv_spans(fast, ref, "prefill")
    one_row = Rollout(ref.tokens, ref.logp, ref.logits, ref.lengths, ref.real_pos, (ref.kv[0],))
    with pytest.raises(ValueError, match="longer than argument 1"):  # every row compared, or none
        judge.kv_spans(one_row, ref)


def test_generated_kv_verdict_names_the_token_whose_kv_differs() -> None:
    fast, ref = _fed_pair()
    verdict = judge.judge_generated_kv(fast, ref, close(atol=0.1, rtol=0.0))
    assert not verdict.passed and "at row 1, layer 0, kv K, head 0, token 0, element (1,)" in verdict.message
    assert verdict.metrics["max_abs"] == pytest.approx(0.25) and verdict.metrics["kv_rows_wrong"] == 0
    assert judge.judge_generated_kv(fast, ref, close(atol=0.25, rtol=0.0)).passed
    assert judge.judge_generated_kv(fast, ref, close(atol=0.1, rtol=0.0), fed=[2, 0]).passed  # only row 0's
    assert judge.judge_prefill_kv(fast, ref, exact()).passed
    assert judge.case_row_metrics(fast, ref)["generated_kv_max_abs"] == pytest.approx(0.25)


def test_a_row_holding_more_or_less_than_its_fed_tokens_kv_fails_naming_its_slots() -> None:
    ref = _fed_pair()[1]
    fact = "every row holds the KV of its prompt and of each token it fed, no more"
    assert judge.fed_kv_rows(ref) == [] and judge.require_fed_kv(judge.judge_tokens(ref, ref, exact()), ref).passed
    wrote_on = Rollout(ref.tokens, ref.logp, ref.logits, ref.lengths, ref.real_pos, (_kv(5, 0.0), _kv(3, 10.0)))
    assert judge.fed_kv_rows(wrote_on) == ["row 0 holds 5 slots, its prompt and fed tokens 4",
                                           "row 1 holds 3 slots, its prompt and fed tokens 4"]
    verdict = judge.judge_generated_kv(wrote_on, ref, close(atol=0.0, rtol=0.0))
    assert verdict.violated_facts == [f"{fact} (row 0 holds 5 slots, its prompt and fed tokens 4; row 1 holds 3 "
                                      "slots, its prompt and fed tokens 4)"]
    assert verdict.metrics["kv_rows_wrong"] == 2 and verdict.margin == 0.0  # the slots both hold agree
    none_fed = Rollout(ref.tokens[:, :1], ref.logp[:, :1], ref.logits[:, :1], torch.tensor([1, 1]), ref.real_pos,
                       (_kv(2, 0.0), _kv(3, 0.0)))
    assert judge.fed_kv_rows(none_fed) == []  # one token emitted, none fed: the prompt alone
    stopped = Rollout(ref.tokens, ref.logp, ref.logits, torch.tensor([0, 2]), ref.real_pos, (_kv(2, 0.0), ref.kv[1]))
    assert judge.fed_kv_rows(stopped) == []  # a row that emitted nothing holds its prompt


def test_compare_cases_merges_quantities_with_the_largest_margin_leading() -> None:
    fast, ref = _fed_pair()
    policies = ar_policies.ARPolicies(exact(), close(atol=1.0, rtol=0.0), close(atol=0.1, rtol=0.0),
                                      close(atol=0.1, rtol=0.0))
    verdict = judge.compare_cases(("tokens", "prefill_kv", "generated_kv"), fast, ref, policies)
    assert not verdict.passed and verdict.headline == "generated_kv_max_abs"
    assert verdict.metrics["generated_kv_max_abs"] == pytest.approx(0.25) and verdict.margin == pytest.approx(2.5)
    assert "generated-KV 2.5e-01" in verdict.metrics["quantities"]
    assert judge.compare_cases(("prefill_kv",), fast, ref, policies).passed
    with pytest.raises(ValueError, match="at least one"):
        judge.compare_cases((), fast, ref, policies)


def test_format_case_row_rows() -> None:
    metrics = {"tokens_equal": True, "logp_max_abs": 1.5e-6, "prefill_kv_max_abs": 0.0, "slot0_max_abs": 2e-7}
    head = "[PASS] unequal real_pos"
    body = ("\n        tokens equal=True  logp max|d|=1.500e-06  prefill-KV max|d|=0.000e+00"
            "  (cache slot 0 max|d|=2.000e-07)")
    assert judge.format_case_row("unequal real_pos", True, metrics) == head + body
    assert judge.format_case_row("unequal real_pos", True, metrics, note="why") == head + body + "\n        why"
    assert judge.format_case_row("b1", False, raised="AssertionError") == "[FAIL] b1\n        raised AssertionError"
    assert judge.format_case_row("b1", False) == (
        "[FAIL] b1\n        tokens equal=None  logp max|d|=nan  prefill-KV max|d|=nan  (cache slot 0 max|d|=nan)")


def test_slot0_verdict_names_row_layer_kv_and_head() -> None:
    fast, ref = _pair()
    bad_kv = fast.kv[1].clone()
    bad_kv[0, 1, 0, 0, 1] += 1.0
    fast = Rollout(fast.tokens, fast.logp, fast.logits, fast.lengths, fast.real_pos, (fast.kv[0], bad_kv))
    verdict = judge.judge_slot0(fast, ref, close(atol=1e-6, rtol=0.0))
    assert not verdict.passed and "at row 1, layer 0, kv V, head 0, element (1,)" in verdict.message


def _spy(sizes: list[int], static: bool = True, dynamic: bool = False) -> SimpleNamespace:
    return SimpleNamespace(batch_sizes=sizes, static=static, dynamic=dynamic)


def test_require_path_needs_every_forward_at_the_batch_size() -> None:
    ref = _pair()[1]
    base = judge.judge_logp(ref, ref, close(atol=0.0, rtol=0.0))
    fact = "every forward ran at batch size 2"
    assert judge.require_path(base, _spy([2, 2, 2]), 2).violated_facts == []
    assert judge.require_path(base, _spy([2, 1, 2]), 2).violated_facts == [fact]
    assert judge.require_path(base, _spy([]), 2).violated_facts == [fact]
    assert judge.require_path(base, _spy([1], static=False, dynamic=True), 1).violated_facts == []


def test_a_left_padded_prefill_mask_with_a_query_row_that_admits_nothing_fails_a_fact() -> None:
    ref = _pair()[1]
    base = judge.judge_logp(ref, ref, close(atol=0.0, rtol=0.0))
    fact = ("every query row of the prefill mask admits a key (an all-False row is NaN under an eager -inf softmax, "
            "and its KV poisons the rows that read it)")
    spy = SimpleNamespace(batch_sizes=[2, 2], static=True, dynamic=False, prefill_pads=("left", "none"),
                          prefill_empty_queries=3)
    assert judge.require_path(base, spy, 2, padding_side="left").violated_facts == [fact]
    assert judge.require_path(base, spy, 2, padding_side="left").metrics["empty_prefill_query_rows"] == 3
    assert judge.require_path(base, SimpleNamespace(**{**vars(spy), "prefill_empty_queries": 0}), 2,
                              padding_side="left").violated_facts == []
    right = SimpleNamespace(**{**vars(spy), "prefill_pads": ("right", "none")})
    assert judge.require_path(base, right, 2, padding_side="right").violated_facts == []  # the caller's mask
    assert ar_spy.empty_query_rows(torch.tensor([[[[True, False], [False, False]]]])) == 1
    assert ar_spy.empty_query_rows(torch.ones(2, 3, dtype=torch.bool)) is None  # a 2-D mask has no query rows


def test_the_prefill_is_the_first_forward_of_several_queries_and_a_decode_step_reads_no_query_rows() -> None:
    blocked = torch.tensor([[[[True, False], [False, False]]]])  # its second query row admits no key
    spy = ARForwardSpy(torch.nn.Identity())
    spy._hook(None, (), {"input_ids": torch.tensor([[4]]), "attention_mask": blocked[..., :1, :]})
    assert spy.calls[-1].empty_queries is None and spy.prefill_empty_queries is None  # one query: a decode step
    spy._hook(None, (), {"input_ids": torch.tensor([[4, 5]]), "attention_mask": blocked})
    assert spy.calls[-1].empty_queries == 1 and spy.prefill_empty_queries == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_additive_mask_admits_a_key_where_its_bias_is_above_half_the_lowest_value(dtype: torch.dtype) -> None:
    low = torch.finfo(dtype).min
    mask = torch.tensor([[[[0.0, -math.inf], [-math.inf, -math.inf], [low, low], [low / 2, low], [-1e4, low],
                           [low * 0.4, low]]]], dtype=dtype)
    assert ar_spy.empty_query_rows(mask) == 3  # -inf alone, the lowest value alone, half of it alone; not 0.4 of it
    assert ar_spy.empty_query_rows(torch.zeros(1, 1, 2, 2, dtype=torch.long)) is None  # neither bool nor additive
    assert ar_spy.empty_query_rows(None) is None


@pytest.mark.parametrize(("pad_id", "vocab"), [(0, 3), (1, 3), (1, 2)])
def test_stock_prefill_floor_draws_every_non_pad_id_and_never_the_pad(pad_id: int, vocab: int) -> None:
    seen = []

    def stock_prefill(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(ids.clone())
        return torch.zeros(*ids.shape, vocab), torch.zeros(ids.shape[0], 1, 2, 1, ids.shape[1], 2)

    backend = SimpleNamespace(pad_id=pad_id, vocab_size=vocab, name="stand-in", stock_prefill=stock_prefill)
    floor = ar_policies.stock_prefill_floor(backend)
    assert (floor.logp, floor.kv, floor.backend) == (0.0, 0.0, "stand-in")
    batched = seen[0]
    assert batched.shape == (4, 6) and [s.shape for s in seen[1:]] == [(1, 6)] * 4
    assert sorted(set(batched.flatten().tolist())) == [i for i in range(vocab) if i != pad_id]
    assert torch.equal(torch.cat(seen[1:]), batched)
    assert not math.isnan(floor.logp)


def test_token_verdict_reports_each_rows_first_divergence() -> None:
    fast, ref = _pair()
    verdict = judge.judge_tokens(fast, ref, exact())
    assert not verdict.passed
    assert verdict.message == "row 1 diverges at decode step 1: token 9 vs 6 (step 0 is read from the prefill)"
    assert judge.judge_tokens(ref, ref, exact()).message == ""


def test_exact_policies_are_exact_everywhere_with_no_floor() -> None:
    policies = ar_policies.exact_policies()
    assert [p.describe() for p in (policies.tokens, policies.logp, policies.kv, policies.slot0)] == [
        exact().describe()] * 4
    assert policies.floor is None


def test_spy_reads_positional_input_ids_and_starts_empty() -> None:
    """The forward spy the path facts read: a forward called positionally counts, each entry starts afresh."""
    model = ar_models.transformers_model("qwen3")
    spy = ARForwardSpy(model)
    with spy:
        assert not spy.static and not spy.dynamic  # no forward proves nothing
    with torch.no_grad(), spy:
        model(torch.tensor([[5, 6, 7]]))
    with torch.no_grad(), spy:  # entering again starts a fresh record
        model(torch.tensor([[5, 6], [7, 8]]))
    assert [(c.batch, c.queries, c.cache) for c in spy.calls] == [(2, 2, "none")]


def test_generated_kv_spans_are_padded_to_the_longest_span_not_past_it() -> None:
    """Each row's KV over its own logical slots, zero-padded on the slot axis to the longest span of the rows."""
    kv = [torch.arange(10.0).reshape(1, 1, 1, 10, 1).expand(2, 2, 3, 10, 4) + row for row in range(2)]
    rollout = Rollout(*(torch.zeros(2, 1),) * 3, torch.zeros(2), torch.zeros(2), kv)
    padded = judge._padded_kv(rollout, [(3, 5), (6, 10)])
    assert padded.shape == (2, 2, 2, 3, 4, 4)
    assert padded[0, 0, 0, 0, :, 0].tolist() == [3.0, 4.0, 0.0, 0.0]
    assert padded[1, 0, 0, 0, :, 0].tolist() == [7.0, 8.0, 9.0, 10.0]
    prompts = Rollout(*(torch.zeros(2, 1),) * 3, torch.zeros(2), torch.tensor([2, 3]), kv)
    prefill = judge._padded_prefill_kv(prompts)  # each row's prompt, from its first slot
    assert prefill[0, 0, 0, 0, :, 0].tolist() == [0.0, 1.0, 0.0]
    assert prefill[1, 0, 0, 0, :, 0].tolist() == [1.0, 2.0, 3.0]
