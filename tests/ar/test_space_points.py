"""The ar input space the catalogue rolls out: its points, the ids that name them, where each is judged, and the
two input classes only some points feed (a bf16 model, an eager kernel)."""

from __future__ import annotations

import itertools

import pytest
import torch

from fixtures import ar_space
from fixtures.ar_cases import eos_for_first_token
from harness.judging import ablation, catalogue, checks, space
from harness.plugins import conformance

pytestmark = pytest.mark.cpu

catalogue.load()


def test_every_point_is_one_check_whose_id_names_it_and_whose_layout_judges_it() -> None:
    assert len(ar_space.POINTS) >= 2 * 2 * 2  # pairwise over two-valued axes beside the models
    for point in ar_space.POINTS:
        check_id = f"ar.space.{space.label(point)}.batched_vs_b1"
        assert str(ar_space.check_id(point)) == check_id and checks.exists(check_id)
        assert space.point(check_id) == point
        assert conformance.layout_scope(check_id) == ("ar", point["padding_side"])
    assert len({str(ar_space.check_id(p)) for p in ar_space.POINTS}) == len(ar_space.POINTS)


def test_the_points_hold_every_pair_of_values_of_any_two_axes() -> None:
    held = {(a, p[a], b, p[b]) for p in ar_space.POINTS for a, b in itertools.combinations(ar_space.AXES, 2)}
    every = {(a, x, b, y) for a, b in itertools.combinations(ar_space.AXES, 2)
             for x in ar_space.AXES[a] for y in ar_space.AXES[b]}
    assert held == every


def test_ids_select_the_points_by_their_values() -> None:
    bf16 = ar_space.ids(dtype="bfloat16")
    assert bf16 and all("-bfloat16-" in check_id for check_id in bf16)
    left_eager = ar_space.ids(padding_side="left", kernel="eager")
    assert left_eager == [check_id for check_id in ar_space.ids(kernel="eager") if "-left-" in check_id]
    assert len(ar_space.ids()) == len(ar_space.POINTS)
    with pytest.raises(KeyError, match="no axis width"):
        ar_space.ids(width="9")


def test_a_first_token_eos_is_a_rows_first_token_that_another_row_goes_on_past() -> None:
    assert eos_for_first_token(torch.tensor([[3, 5], [3, 7], [4, 4]])) == (3,)  # rows 0 and 1 stop, row 2 goes on
    assert eos_for_first_token(torch.tensor([[3, 4], [4, 3]])) == (3,)  # row 1 meets it later, and goes on to it
    assert eos_for_first_token(torch.tensor([[3, 6], [3, 6]])) == ()  # every row would stop at once


def test_the_log_softmax_in_the_model_dtype_is_seen_at_a_bf16_point_only(parity_session, parity_ctx) -> None:
    """Its claims are exactly the bf16 points; under it a float32 point still passes (the cast is the identity)
    and a bfloat16 point fails on its record (each log-prob a bf16 ulp off the fp64 softmax of its logits)."""
    item = ablation.get("ar.logp_in_model_dtype")
    assert list(item.kills) == ar_space.ids(dtype="bfloat16")
    fp32, bf16 = ar_space.ids(dtype="float32")[0], ar_space.ids(dtype="bfloat16")[0]
    with item.apply():
        passed = checks.run_check(fp32, parity_ctx)
    assert passed.passed, passed.describe()
    killed = parity_session.kill(item.name, bf16, parity_ctx)
    assert killed.killed and killed.margin > 100, killed.detail
    assert "recorded log-prob vs fp64 softmax" in killed.detail


def test_a_cache_sized_past_the_rollout_is_the_one_the_point_rolls_out_over() -> None:
    """A blocks point rolls out over a 64-slot cache and a maximum point over its longer one (every forward's cache
    read by the spy); the exact points pass no size at all."""
    width, new = ar_space.CASE.batch().width, ar_space.CASE.max_new_tokens
    needed = width + new
    assert ar_space.cache_slots({"capacity": "exact"}, width, new) is None
    blocks = ar_space.cache_slots({"capacity": "blocks"}, width, new)
    maximum = ar_space.cache_slots({"capacity": "maximum"}, width, new)
    assert blocks % ar_space.BLOCK_SLOTS == 0 and needed <= blocks < needed + ar_space.BLOCK_SLOTS
    assert maximum >= max(ar_space.MAXIMUM_SLOTS, needed) and maximum != blocks


def test_a_cache_too_small_for_the_rollout_is_refused_naming_both_sizes() -> None:
    from fixtures import ar_models
    from harness.ar import loop

    backend, batch = ar_models.backend("fake", "sdpa", "float32"), ar_space.CASE.batch()
    needed = batch.width + ar_space.CASE.max_new_tokens
    with pytest.raises(ValueError, match=f"cache_slots={needed - 1} is too few.*at least {needed}"):
        loop.init_state(backend, batch, ar_space.CASE.max_new_tokens, cache_slots=needed - 1)
    assert loop.cache_length(batch.width, ar_space.CASE.max_new_tokens, needed) == needed  # exactly enough is enough


def test_the_mask_sized_to_the_rollout_is_seen_only_over_a_longer_cache(parity_session, parity_ctx) -> None:
    """Its claims are exactly the blocks and maximum points; under it an exact point still passes."""
    item = ablation.get("ar.key_axis_sized_to_the_rollout")
    assert sorted(item.kills) == sorted(ar_space.ids(capacity="blocks") + ar_space.ids(capacity="maximum"))
    with item.apply():
        for check_id in ar_space.ids(capacity="exact"):
            passed = checks.run_check(check_id, parity_ctx)
            assert passed.passed, passed.describe()
    killed = parity_session.kill(item.name, ar_space.ids(capacity="blocks")[0], parity_ctx)
    assert killed.killed, killed.detail


def test_an_implementation_is_judged_on_the_exact_points_only() -> None:
    """The contract passes no capacity: a point that sizes the cache judges only the suite's rollout."""
    for point in ar_space.POINTS:
        check_id = str(ar_space.check_id(point))
        assert (check_id in conformance.NOT_JUDGED) == (point["capacity"] != "exact"), point
        if point["capacity"] != "exact":
            assert "the implementation's own choice" in conformance.NOT_JUDGED.get(check_id)


def test_the_points_an_implementation_is_judged_on_hold_every_pair_by_themselves() -> None:
    """Under --impl only the exact-capacity points run: they alone hold every pair of the other axes."""
    exact = [p for p in ar_space.POINTS if p["capacity"] == "exact"]
    axes = [name for name in ar_space.AXES if name != "capacity"]
    held = {(a, p[a], b, p[b]) for p in exact for a, b in itertools.combinations(axes, 2)}
    every = {(a, x, b, y) for a, b in itertools.combinations(axes, 2)
             for x in ar_space.AXES[a] for y in ar_space.AXES[b]}
    assert held == every
