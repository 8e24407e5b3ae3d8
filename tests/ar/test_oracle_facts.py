"""The greedy log-prob oracle judges each rollout on its own: a fast path whose picks leave the fp64 argmax fails
even when the stock rollout it is compared beside is right (and the other way round)."""

from __future__ import annotations

import pytest
import torch

from fixtures import ar_models
from fixtures.ar_cases import EXTRA
from harness.ar import comparisons, loop
from harness.judging.compare import close

pytestmark = pytest.mark.cpu

FACT = "every token is the fp64 argmax of its logits, and no row goes on past its EOS"


def _runner_up_once(original):
    """A greedy pick that takes the second-best token of row 0 at step 1 (its log-prob recorded for it)."""

    def pick(state: loop.ARState, row_logits: torch.Tensor) -> None:
        original(state, row_logits)
        if state.step_idx == 1:
            second = row_logits[0].topk(2).indices[1]
            state.tokens[0, 1] = second
            state.logp[0, 1] = loop.token_logprob(row_logits[0], second)
            state.input_ids = loop.place_token(state.input_ids, state.tokens[:, 1],
                                               state.backend.token_columns(state))  # over the token just placed

    return pick


def _oracle() -> list[str]:
    case = EXTRA["rollout_vs_replay"]
    verdict = comparisons.check_greedy_logp_oracle(ar_models.backend("fake"), case.batch(),
                                             case.max_new_tokens, close(atol=1e-5, rtol=0.0))
    return verdict.violated_facts


def test_the_oracle_passes_greedy_rollouts() -> None:
    assert _oracle() == []


def test_a_fast_pick_off_the_argmax_fails_the_oracle_while_the_stock_one_is_right(monkeypatch) -> None:
    monkeypatch.setattr(loop, "_sample", _runner_up_once(loop._sample))
    assert _oracle() == [f"{FACT} (fast row 0 step 1 is not the fp64 argmax of its logits)"]


def test_a_stock_pick_off_the_argmax_fails_the_oracle_while_the_fast_one_is_right(monkeypatch) -> None:
    stock = loop.stock_rollout

    def shifted(*args, **kwargs) -> loop.Rollout:
        rollout = stock(*args, **kwargs)
        tokens = rollout.tokens.clone()
        tokens[0, 1] = rollout.logits[0, 1].topk(2).indices[1]
        return loop.Rollout(tokens, rollout.logp, rollout.logits, rollout.lengths, rollout.real_pos, rollout.kv)

    monkeypatch.setattr(loop, "stock_rollout", shifted)
    assert _oracle() == [f"{FACT} (stock row 0 step 1 is not the fp64 argmax of its logits)"]


def test_a_row_read_past_its_eos_is_named_as_such_not_as_an_argmax_miss() -> None:
    """A rollout that kept a row going one step past its EOS: the oracle says so, with the row and the step."""
    rollout = loop.stock_rollout(ar_models.backend("fake"), EXTRA["rollout_vs_replay"].batch().prompts(), 4, ())
    eos = int(rollout.tokens[0, 1])
    _, _, wrong = comparisons._oracle_errors(rollout, (eos,))
    ended = rollout.tokens[0].tolist().index(eos)
    assert wrong[0] == f"row 0 went on {int(rollout.lengths[0]) - 1 - ended} step(s) past its EOS at step {ended}"


def test_the_finished_rows_fact_names_each_row_that_stopped_elsewhere_and_both_lengths() -> None:
    assert comparisons.stop_fact([3, 5], [3, 5]) == "every row stops where its B=1 run stopped at EOS"
    assert comparisons.stop_fact([3, 5, 2], [3, 4, 6]) == (
        "every row stops where its B=1 run stopped at EOS (row 1 emitted 5 tokens, its B=1 run 4; row 2 emitted 2 "
        "tokens, its B=1 run 6)")
    assert comparisons.stop_fact([3], [3, 4]).endswith("(row 1 emitted no tokens, its B=1 run 4)")
    assert comparisons.stop_fact([3, 4], [3]).endswith("(row 1 emitted 4 tokens, its B=1 run none)")


def test_many_wrong_picks_are_shown_four_at_a_time_with_a_count_of_the_rest(monkeypatch) -> None:
    """Row 0 takes its runner-up at every decode step: the fact names the first four misses and counts the rest."""
    original = loop._sample

    def pick(state: loop.ARState, row_logits: torch.Tensor) -> None:
        original(state, row_logits)
        step = state.step_idx
        if step >= 1:
            second = row_logits[0].topk(2).indices[1]
            state.tokens[0, step] = second
            state.logp[0, step] = loop.token_logprob(row_logits[0], second)
            state.input_ids = loop.place_token(state.input_ids, state.tokens[:, step],
                                               state.backend.token_columns(state))

    monkeypatch.setattr(loop, "_sample", pick)
    (violated,) = _oracle()
    shown = violated.removeprefix(f"{FACT} (").removesuffix(")").split("; ")
    misses = EXTRA["rollout_vs_replay"].max_new_tokens - 1
    assert misses > 4, "the case must have more wrong picks than the fact shows"
    assert shown[:4] == [f"fast row 0 step {step} is not the fp64 argmax of its logits" for step in range(1, 5)]
    assert shown[4:] == [f"and {misses - 4} more"], violated
