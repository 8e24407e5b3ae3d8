"""The greedy log-prob oracle judges each rollout on its own: a fast path whose picks leave the fp64 argmax fails
even when the stock rollout it is compared beside is right (and the other way round)."""

from __future__ import annotations

import pytest
import torch

from fixtures import ar_models
from fixtures.ar_cases import EXTRA
from harness.ar import comparisons, loop
from harness.compare import close

pytestmark = pytest.mark.cpu

FACT = "every token is the fp64 argmax of its logits"


def _runner_up_once(original):
    """A greedy pick that takes the second-best token of row 0 at step 1 (its log-prob recorded for it)."""

    def pick(state: loop.ARState, row_logits: torch.Tensor) -> None:
        original(state, row_logits)
        if state.step_idx == 1:
            second = row_logits[0].topk(2).indices[1]
            state.tokens[0, 1] = second
            state.logp[0, 1] = loop.token_logprob(row_logits[0], second)
            state.input_ids = loop.place_token(state.input_ids, state.tokens[:, 1],
                                               state.backend.token_columns(state))

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
    assert FACT in _oracle()


def test_a_stock_pick_off_the_argmax_fails_the_oracle_while_the_fast_one_is_right(monkeypatch) -> None:
    stock = loop.stock_rollout

    def shifted(*args, **kwargs) -> loop.Rollout:
        rollout = stock(*args, **kwargs)
        tokens = rollout.tokens.clone()
        tokens[0, 1] = rollout.logits[0, 1].topk(2).indices[1]
        return loop.Rollout(tokens, rollout.logp, rollout.logits, rollout.lengths, rollout.real_pos, rollout.kv)

    monkeypatch.setattr(loop, "stock_rollout", shifted)
    assert FACT in _oracle()
