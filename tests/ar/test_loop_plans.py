"""What the batched loops make once per rollout instead of once per step, held to what they replace.

While no row has finished every row feeds the same count, so each decode step's mask is built before the first
decode step from one call of the backend's key masks over every step's counts; the per-step views of the outputs
and of the token buffer are made once; a fast rollout's KV in logical order is gathered when a check first reads
it. Each must equal, step by step, what the per-step code computes.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

from fixtures import ar_models
from fixtures.ar_cases import prompt_ids
from harness.ar import backends, left_padded, loop, masks
from harness.ar.batch import right_padded_batch

pytestmark = pytest.mark.cpu

PAD = ar_models.PAD_ID
LENGTHS = (5, 9, 3)
STEPS = 5


class OneStepOnly:
    """A backend whose ``key_valid`` reads only the last step of the counts it is given (it does not broadcast)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def key_valid(self, state: loop.ARState, generated: torch.Tensor, key_length: int) -> torch.Tensor:
        return self.inner.key_valid(state, generated.reshape(-1, generated.shape[-1])[-1], key_length)


def _right_state(model: str) -> loop.ARState:
    batch = right_padded_batch(prompt_ids(LENGTHS, seed=81), PAD)
    return loop.init_state(ar_models.backend(model), batch, STEPS)


@pytest.mark.parametrize("model", ar_models.SHIPPED_MODELS)
def test_every_decode_steps_mask_is_the_mask_of_that_steps_counts(model: str) -> None:
    state = _right_state(model)
    with torch.no_grad():
        loop.step(state)
        views = loop.StepViews.of(state)
        uniform = loop._uniform_masks(state, views)
        assert uniform is not None and len(uniform) == STEPS and uniform[0] is None
        keys = state.backend.decode_key_length(state)
        for k in range(1, STEPS):
            counts = torch.full((len(LENGTHS),), k, dtype=torch.long)
            expected = masks.decode_mask(state.backend.key_valid(state, counts, keys))
            assert torch.equal(uniform[k], expected), f"step {k}"


@pytest.mark.parametrize("model", ar_models.SHIPPED_MODELS)
def test_every_left_padded_decode_steps_mask_is_the_mask_of_that_steps_counts(model: str) -> None:
    batch = left_padded.left_padded_batch(prompt_ids(LENGTHS, seed=82), PAD)
    state = left_padded.init_state(ar_models.backend(model), batch, STEPS)
    layout, plan = state.backend, state.extra["left_padded"]
    uniform = left_padded._uniform_masks(state, layout, plan, loop.StepViews.of(state))
    assert uniform is not None and len(uniform) == STEPS and uniform[0] is None
    keys = layout.decode_key_length(state)
    for k in range(1, STEPS):
        counts = torch.full((len(LENGTHS),), k, dtype=torch.long)
        assert torch.equal(uniform[k], left_padded.decode_key_mask(*layout.key_masks(plan, counts, keys))), k


def test_a_dynamic_cache_builds_no_step_masks_ahead() -> None:
    """B = 1 keeps the trimmed dynamic cache, whose key axis grows: each step builds its own mask."""
    batch = right_padded_batch(prompt_ids((6,), seed=83), PAD)
    state = loop.init_state(ar_models.backend("fake"), batch, STEPS)
    with torch.no_grad():
        loop.step(state)
    assert loop._uniform_masks(state, loop.StepViews.of(state)) is None


def test_a_key_valid_that_does_not_broadcast_over_steps_is_named() -> None:
    batch = right_padded_batch(prompt_ids(LENGTHS, seed=84), PAD)
    said = r"OneStepOnly\.key_valid must broadcast .* counts \(4, 3\) gave \(3, 14\), not \(4, 3, 14\)"
    with pytest.raises(TypeError, match=said):
        loop.fast_rollout(OneStepOnly(ar_models.backend("qwen3")), batch, STEPS)


def test_left_padded_key_masks_that_do_not_broadcast_over_steps_are_named() -> None:
    layout = left_padded.SharedColumns(ar_models.backend("qwen3"))
    layout.key_masks = lambda plan, generated, keys: (torch.zeros(3, keys, dtype=torch.bool), plan.pads[:, :keys])
    batch = left_padded.left_padded_batch(prompt_ids(LENGTHS, seed=84), PAD)
    with pytest.raises(TypeError, match=r"SharedColumns\.key_masks must broadcast .* gave \(3, 14\)"):
        left_padded.fast_left_rollout(layout, batch, STEPS)


def test_a_mask_seam_that_gives_none_gives_none_at_every_step() -> None:
    assert loop.per_step(None, 3) == [None, None, None, None]
    stacked = torch.arange(6).reshape(3, 2)
    assert [None if m is None else m.tolist() for m in loop.per_step(stacked, 3)] == [None, [0, 1], [2, 3], [4, 5]]


def test_step_views_are_dropped_once_the_state_holds_other_outputs() -> None:
    state = _right_state("qwen3")
    views = loop.StepViews.of(state)
    assert views is not None and loop.StepViews.of(state) is views
    assert views.count_table.shape == (STEPS + 1, 3) and len(views.counts) == STEPS + 1
    assert [c.tolist() for c in views.counts[:3]] == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]
    views.token_columns[1].fill_(7)
    assert state.tokens[:, 1].tolist() == [7, 7, 7]
    state.tokens = state.tokens.clone()
    assert loop.StepViews.of(state) is None
    state = _right_state("qwen3")
    assert loop.StepViews.of(state) is not None
    state.logits = state.logits.clone()
    assert loop.StepViews.of(state) is None


def test_a_step_writes_into_outputs_the_state_was_handed_after_its_views_were_made() -> None:
    state = _right_state("qwen3")
    with torch.no_grad():
        loop.step(state)
        state.tokens = state.tokens.clone()
        state.logits = state.logits.clone()
        loop.step(state)
    assert bool((state.logits[:, 1] != 0).all(dim=-1).all())
    assert torch.equal(state.tokens[:, 1], state.logits[:, 1].argmax(dim=-1))
    assert state.lengths.tolist() == [2, 2, 2] and state.generated.tolist() == [1, 1, 1]


def test_finished_rows_sees_a_row_finished_in_place() -> None:
    state = _right_state("qwen3")
    assert loop.finished_rows(state) == (False, False)
    state.finished[1] = True
    assert loop.finished_rows(state) == (True, False)
    state.finished.fill_(True)
    assert loop.finished_rows(state) == (True, True)


def test_the_token_buffer_grows_through_views_of_one_buffer() -> None:
    state = _right_state("qwen3")
    width = state.batch.width
    assert state.token_buffer.shape == (3, width + STEPS) and state.input_ids._base is state.token_buffer
    assert torch.equal(state.input_ids, state.batch.input_ids) and bool((state.token_buffer[:, width:] == PAD).all())
    grown = state.grown_input_ids()
    assert grown.shape[1] == width + 1 and grown._base is state.token_buffer
    with torch.no_grad():
        for _ in range(STEPS):
            loop.step(state)
    assert state.input_ids.shape[1] == width + STEPS and state.input_ids._base is state.token_buffer
    assert torch.equal(state.token_buffer[:, width:], state.tokens)  # the hole layout: token k at column W + k


def test_the_row_slot_layout_holds_the_prompt_in_slot_order_after_the_prefill() -> None:
    """Upstream's layout: column == cache slot, so after the left-padded prefill real token t sits at column t."""
    prompts = prompt_ids(LENGTHS, seed=87)
    state = left_padded.init_state(ar_models.backend("fake"), left_padded.left_padded_batch(prompts, PAD), STEPS)
    with torch.no_grad():
        state.backend.prefill(state, state.extra["left_padded"])
    for row, prompt in enumerate(prompts):
        assert state.input_ids[row, : len(prompt)].tolist() == list(prompt), row
    assert state.input_ids._base is state.token_buffer


def test_the_kv_of_buffers_of_several_shapes_is_read_row_by_row() -> None:
    """Layers of different slot counts cannot be stacked into one tensor: each row is gathered layer by layer."""
    keys = [torch.arange(2 * 2 * n * 3, dtype=torch.float32).reshape(2, 2, n, 3) for n in (4, 6)]
    buffers = [(k, -k) for k in keys]
    slots = [torch.tensor([0, 2]), torch.tensor([1])]
    rows = loop._rows_kv(buffers, slots)
    for row, index in enumerate(slots):
        for layer, (k, v) in enumerate(buffers):
            assert torch.equal(rows[row][layer], torch.stack([k[row][:, index], v[row][:, index]]))


def test_a_loop_that_keeps_its_own_token_buffer_feeds_its_own_column() -> None:
    """The shared-column layouts read ``state.input_ids``: a loop growing a tensor of its own is fed from it."""
    state = _right_state("qwen3")
    state.step_idx = 2
    width = state.batch.width
    state.input_ids = torch.arange(3 * (width + 4)).reshape(3, width + 4)  # wider than the steps so far
    ids, positions, slots = backends.shared_column_inputs(state, lambda: state.real_pos, False)
    assert ids.tolist() == [[row * (width + 4) + width + 1] for row in range(3)] and slots is None
    assert positions.flatten().tolist() == [n + 1 for n in LENGTHS]
    state.input_ids = state.token_buffer[:, : width + 2]
    state.token_buffer[:, width + 1] = 42
    assert backends.shared_column_inputs(state, lambda: state.real_pos, True)[0].flatten().tolist() == [42] * 3


def test_the_kv_of_a_fast_rollout_is_read_when_first_asked_and_pickles_as_a_tuple() -> None:
    backend = ar_models.backend("fake")
    batch = right_padded_batch(prompt_ids(LENGTHS, seed=85), PAD)
    rollout = loop.fast_rollout(backend, batch, STEPS)
    kv = rollout.kv
    assert isinstance(kv, loop.LogicalKV) and len(kv) == 3 and repr(kv) == "LogicalKV(3 rows)"
    rows = list(kv)
    assert repr(kv) == "LogicalKV(3 rows, read)" and all(r.dtype == torch.float32 for r in rows)
    assert [r.shape[-2] for r in rows] == [n + STEPS - 1 for n in LENGTHS]  # the last token's KV is never written
    assert torch.equal(rollout.prefill_kv(1), rows[1][..., : LENGTHS[1], :])
    copied = pickle.loads(pickle.dumps(kv))
    assert type(copied) is tuple and all(torch.equal(a, b) for a, b in zip(copied, rows, strict=True))


def test_every_row_emitting_at_every_step_records_every_log_prob() -> None:
    rollout = loop.fast_rollout(ar_models.backend("qwen3"), right_padded_batch(prompt_ids(LENGTHS, seed=86), PAD),
                                STEPS)
    assert rollout.lengths.tolist() == [STEPS] * 3
    assert torch.equal(rollout.logp, loop.token_logprob(rollout.logits, rollout.tokens))
    assert bool((rollout.logp < 0).all())
