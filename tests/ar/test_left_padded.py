"""The left-padded layout's pieces on tiny inputs: the batch builder, positions, masks, slots, the loop against B=1,
the layout facts a conformance run reads off the model's forwards, and what each left-padded ablation does to the
forwards (each is the bug it claims to be, not just something that fails).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import pytest
import torch

from fixtures import ar_models
from fixtures.ar_cases import eos_for_stops, prompt_ids
from harness.ar import comparisons, judge, left_padded, loop, probes
from harness.ar import policies as ar_policies
from harness.ar.batch import right_padded_batch
from harness.ar.left_padded import LeftPaddedBatch, left_padded_batch
from harness.ar.spy import ARForwardSpy, row_padding
from harness.judging import ablation, catalogue
from harness.judging.compare import holds
from harness.plugins import conformance

pytestmark = pytest.mark.cpu

PAD = ar_models.PAD_ID
LENGTHS = (5, 9, 3)


def _batch(lengths: tuple[int, ...] = LENGTHS, seed: int = 71, width: int | None = None) -> LeftPaddedBatch:
    return left_padded_batch(prompt_ids(lengths, seed=seed), PAD, width=width)


# --------------------------------------------------------------------------------------------- the batch


def test_rows_are_padded_first_and_read_back_unpadded() -> None:
    prompts = prompt_ids(LENGTHS, seed=71)
    batch = left_padded_batch(prompts, PAD, width=11)
    assert (batch.batch_size, batch.width, left_padded.padding_side(batch)) == (3, 11, "left")
    assert batch.lengths.tolist() == list(LENGTHS) and batch.real_pos.tolist() == [[n] for n in LENGTHS]
    for row, prompt in enumerate(prompts):
        pads = 11 - prompt.numel()
        assert (batch.input_ids[row, :pads] == PAD).all() and torch.equal(batch.input_ids[row, pads:], prompt)
        assert not batch.attention_mask[row, :pads].any() and batch.attention_mask[row, pads:].all()
        assert torch.equal(batch.prompts()[row], prompt)
    assert row_padding(batch.input_ids, PAD) == ("left", "left", "left")
    assert left_padded.padding_side(right_padded_batch(prompts, PAD)) == "right"


def test_the_builder_refuses_what_it_cannot_pad() -> None:
    with pytest.raises(ValueError, match="at least one prompt"):
        left_padded_batch([], PAD)
    with pytest.raises(ValueError, match="prompt 1 must be a non-empty"):
        left_padded_batch([[3, 4], []], PAD)
    with pytest.raises(ValueError, match="width 4 is shorter than the longest prompt"):
        left_padded_batch([[3, 4, 5, 6, 7]], PAD, width=4)


def test_the_rollout_refuses_a_batch_that_is_not_left_padded() -> None:
    backend = ar_models.backend("qwen3")
    batch = _batch()
    right = torch.flip(batch.attention_mask, dims=[1])  # pads last: the right-padded mask
    for mask, match in ((right, r"rows \[0, 2\] are not left-padded"),
                        (batch.attention_mask & (torch.arange(9) < 8), "a pad follows a real token"),
                        (batch.attention_mask & (torch.arange(3) != 1)[:, None], r"rows \[1\] .* no real token")):
        with pytest.raises(ValueError, match=match):
            left_padded.fast_left_rollout(backend, LeftPaddedBatch(batch.input_ids, mask, PAD), 2)
    with pytest.raises(ValueError, match="needs a left-padded batch"):
        left_padded.fast_left_rollout(backend, right_padded_batch(batch.prompts(), PAD), 2)


# --------------------------------------------------------------------------------------------- positions and masks


def test_positions_start_every_prompt_at_zero_and_continue_past_it_for_the_pads() -> None:
    mask = torch.tensor([[False, False, True, True, True], [True, True, True, True, True],
                         [False, False, False, False, True]])
    assert left_padded.left_positions(mask).tolist() == [[3, 4, 0, 1, 2], [0, 1, 2, 3, 4], [1, 2, 3, 4, 0]]
    assert left_padded.decode_start(torch.tensor([3, 5, 1]), 5).tolist() == [3, 5, 1]
    assert left_padded.first_logits_column(torch.tensor([3, 5, 1]), 5).tolist() == [4, 4, 4]


def test_prefill_mask_admits_real_keys_causally_and_gives_a_pad_query_slot_zero() -> None:
    mask = torch.tensor([[False, True, True], [True, True, True]])
    columns = torch.arange(3).expand(2, -1)
    shared = left_padded.prefill_mask(mask, columns, 5)
    assert shared.shape == (2, 1, 3, 5) and not shared[..., 3:].any()  # the decode slots: not written yet
    assert shared[0, 0, :, :3].tolist() == [[True, False, False], [False, True, False], [False, True, True]]
    assert torch.equal(shared[1, 0, :, :3], torch.ones(3, 3, dtype=torch.bool).tril())
    # per-row slots: the same admissions, each key at the slot its column writes (real token t at slot t)
    positions = left_padded.left_positions(mask)
    per_row = left_padded.prefill_mask(mask, positions, 5)
    assert per_row[0, 0, :, :3].tolist() == [[True, False, False], [True, False, False], [True, True, False]]
    assert left_padded.prefill_mask(mask, positions, 2).shape == (2, 1, 3, 2)  # a dynamic cache's trimmed keys


def test_decode_mask_is_every_written_slot_but_the_pads() -> None:
    written = torch.tensor([[True, True, True, False], [True, True, False, False]])
    pads = torch.tensor([[True, False, False, False], [False, False, False, False]])
    assert left_padded.decode_key_mask(written, pads)[:, 0, 0].tolist() == [[False, True, True, False],
                                                                            [True, True, False, False]]


def test_per_row_slots_mark_written_only_the_prompt_the_pads_and_the_fed_tokens() -> None:
    """HunyuanImage-3's per-row slots, width 4, prompts of 2 and 4, one token fed: row 0 wrote its prompt at [0, 2),
    its pads at [2, 4) and the token over slot 2; row 1 its prompt at [0, 4) and the token at 4. No slot past that is
    written, and only row 0's pads hold a pad's KV (both after the prefill, slot 3 once the token is fed)."""
    batch = left_padded_batch(prompt_ids((2, 4), seed=85), PAD)
    state = left_padded.init_state(ar_models.backend("fake"), batch, 3)
    layout, plan = state.backend, state.extra["left_padded"]
    assert isinstance(layout, left_padded.RowSlots)
    written, pads = layout.key_masks(plan, torch.tensor([[0, 0], [1, 1]]), 6)  # after the prefill; one token fed
    assert written.tolist() == [[[True] * 4 + [False] * 2] * 2, [[True] * 4 + [False] * 2, [True] * 5 + [False]]]
    assert pads.tolist() == [[[False] * 2 + [True] * 2 + [False] * 2, [False] * 6],
                             [[False] * 3 + [True] + [False] * 2, [False] * 6]]


@pytest.mark.parametrize(("model", "slots"), [("qwen3", [[4, 5, 6, 7, 8, 9, 10], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
                                                          [6, 7, 8, 9, 10]]),
                                             ("fake", [[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
                                                       [0, 1, 2, 3, 4]])])
def test_each_backend_contract_has_its_slots(model: str, slots: list[list[int]]) -> None:
    """Shared columns: row i's prompt at [W - n_i, W), token k at W + k; per-row slots: prompt at [0, n_i)."""
    layout = left_padded.layout_for(ar_models.backend(model))
    assert isinstance(layout, left_padded.RowSlots if model == "fake" else left_padded.SharedColumns)
    assert [layout.logical_slots(n, 9, 2).tolist() for n in LENGTHS] == slots
    dead = probes.dead_slots(layout, _batch(), 12)
    alive = [(~dead[row]).nonzero().flatten().tolist() for row in range(3)]
    assert alive == [s[:-2] for s in slots]  # right after the prefill: the prompt's slots only


# --------------------------------------------------------------------------------------------- the loop


def test_the_left_padded_rollout_equals_each_prompt_alone() -> None:
    """One prefill and one forward per step, pads read left, each row its B=1 run (the catalogue holds every model
    to it; here the pieces of the verdict are read one by one)."""
    backend = ar_models.backend("qwen3")
    batch = _batch()
    stock = loop.stock_rollout(backend, batch.prompts(), 5)
    floor = ar_policies.stock_prefill_floor(backend, rows=3, length=batch.width)
    with ARForwardSpy(backend.model, pad_id=PAD) as spy:
        fast = left_padded.fast_left_rollout(backend, batch, 5)
    policies = ar_policies.fp32_policies(floor)
    for what in ("tokens", "logp", "prefill_kv"):
        verdict = judge.require_path(judge.compare_case(what, fast, stock, policies), spy, 3, padding_side="left")
        assert verdict.passed, verdict.describe()
    assert spy.prefill_pads == ("left", "none", "left") and fast.real_pos.tolist() == list(LENGTHS)
    assert [c.queries for c in spy.calls] == [9, 1, 1, 1, 1]  # one prefill, one forward per decode step


def test_finished_rows_stop_and_freeze_in_a_shared_column_layout() -> None:
    backend = ar_models.backend("qwen3")
    batch = _batch()
    unstopped = left_padded.fast_left_rollout(backend, batch, 6)
    eos, lengths = eos_for_stops(unstopped.tokens, {2: 1})  # row 2 stops at its second token
    assert max(lengths) > 2, "another row must go on"
    run = probes.footprint_rollout(left_padded.layout_for(backend), batch, 6, eos,
                                   rollout=lambda _view, *args: left_padded.fast_left_rollout(backend, *args))
    assert run.rollout.lengths.tolist() == lengths and run.static and not run.stray_writes
    for row, n in enumerate(lengths):
        assert (run.rollout.tokens[row, n:] == PAD).all() and (run.rollout.logp[row, n:] == 0).all()
        assert torch.equal(run.rollout.tokens[row, :n], unstopped.tokens[row, :n])


# --------------------------------------------------------------------------------------------- layout facts


def test_a_layout_mismatch_is_named_with_its_rows() -> None:
    spy = ARForwardSpy(torch.nn.Identity(), pad_id=PAD)
    ids = right_padded_batch(prompt_ids(LENGTHS, seed=71), PAD).input_ids
    spy._hook(None, (), {"input_ids": ids})
    assert spy.prefill_pads == ("right", "none", "right")
    base = holds(True, "numbers")
    assert judge.require_layout(base, spy, "right").passed and judge.layout_mismatch(spy, "right") == ""
    verdict = judge.require_layout(base, spy, "left")
    assert not verdict.passed and verdict.message.startswith("layout mismatch: these checks judge padding_side='left'")
    assert "row 0: pads last, row 2: pads last" in verdict.message
    assert "declare padding_side = 'right'" in verdict.message
    assert verdict.violated_facts[0].startswith("the prefill rows reached the model left-padded")
    base = base.require(True, "every forward at the full batch")
    verdict = judge.require_layout(base, spy, "left")
    assert verdict.notes[0].startswith("VIOLATED: the prefill rows reached the model left-padded")
    assert verdict.notes[1:] == base.notes and len(base.notes) >= 2  # the layout leads, every earlier note follows
    spy._hook(None, (), {"input_ids": torch.tensor([[PAD, 3, PAD]])})
    assert spy.prefill_pads == ("right", "none", "right")  # the first multi-token forward is the prefill
    inside = ARForwardSpy(torch.nn.Identity(), pad_id=PAD)
    inside._hook(None, (), {"input_ids": torch.tensor([[PAD, 3, PAD], [4, 5, 6]])})
    assert "row 0: pads inside the row" in judge.layout_mismatch(inside, "left")
    assert "pad every row on one side" in judge.layout_mismatch(inside, "left")


def test_a_two_token_prefill_is_a_prefill_and_a_one_token_step_is_not() -> None:
    spy = ARForwardSpy(torch.nn.Identity(), pad_id=PAD)
    spy._hook(None, (), {"input_ids": torch.tensor([[PAD], [4]])})
    assert spy.prefill_pads == ()  # a decode step's single column has no padding side
    spy._hook(None, (), {"input_ids": torch.tensor([[PAD, 3], [4, 5]])})
    assert spy.prefill_pads == ("left", "none")


def test_a_mismatch_is_named_when_every_row_is_padded() -> None:
    """An implementation that pads every row (to a multiple of 8, say) leaves no unpadded row: still named; and a
    prefill with no pad at all has no layout to judge, so the verdict is left as it was."""
    spy = ARForwardSpy(torch.nn.Identity(), pad_id=PAD)
    spy._hook(None, (), {"input_ids": torch.tensor([[PAD, PAD, 3], [PAD, 4, 5]])})
    assert spy.prefill_pads == ("left", "left")
    base = holds(True, "numbers")
    verdict = judge.require_layout(base, spy, "right")
    assert not verdict.passed and "row 0: pads first, row 1: pads first" in verdict.message
    unpadded = ARForwardSpy(torch.nn.Identity(), pad_id=PAD)
    unpadded._hook(None, (), {"input_ids": torch.tensor([[3, 4], [5, 6]])})
    assert judge.require_layout(base, unpadded, "left") == base


@contextmanager
def _under_test(spec: str) -> Iterator[None]:
    catalogue.load()
    saved = conformance.specs()
    conformance.clear()
    try:
        conformance.use("ar", spec)
        yield
    finally:
        conformance.clear()
        for path, given in saved.items():
            conformance.use(path, given)


def test_conformance_judges_each_layout_by_what_the_callable_declares() -> None:
    with _under_test("harness.ar.left_padded:fast_left_rollout"):
        reason = conformance.judged_by("ar.qwen3.unequal_real_pos.tokens")
        assert reason is not None and "declaring padding_side = 'right'" in reason
        assert "declares padding_side = 'left'" in reason
        assert conformance.judged_by("ar.qwen3.left.unequal_real_pos.tokens") is None
        assert conformance.judged_by("ar.gpu.left.batched_vs_b1") is None
    with _under_test("harness.ar.loop:fast_rollout"):
        assert conformance.judged_by("ar.qwen3.unequal_real_pos.tokens") is None
        assert "declaring padding_side = 'left'" in conformance.judged_by("ar.fake.left.finished_rows")
    assert conformance.declared_layout("ar", loop.fast_rollout) == "right"
    assert conformance.declared_layout("decode", loop.fast_rollout) is None


def sideways(backend: Any, batch: Any, max_new_tokens: int, eos: Any = ()) -> loop.Rollout:
    """A rollout declaring nothing (right) that left-pads its prompts anyway, then raises after the prefill."""
    left_padded.fast_left_rollout(backend, left_padded_batch(batch.prompts(), batch.pad_id), 1)
    raise RuntimeError("a later step failed")


def test_an_implementation_that_raises_after_a_mismatched_prefill_is_named_by_its_layout() -> None:
    with pytest.raises(ValueError, match="padding_side = 'diagonal'"):
        conformance.declared_layout("ar", type("F", (), {"padding_side": "diagonal"})())
    batch = right_padded_batch(prompt_ids(LENGTHS, seed=71), PAD)
    expected = pytest.raises(comparisons.LayoutMismatch, match="layout mismatch")
    with _under_test(f"{__name__}:sideways"), expected as raised:
        comparisons.compare_batched("tokens", ar_models.backend("qwen3"), batch, 3, None, None)
    assert isinstance(raised.value.__cause__, RuntimeError)


# --------------------------------------------------------------------------------------------- the ablations


@contextmanager
def _forwards(model: Any) -> Iterator[list[dict[str, Any]]]:
    """Every forward's position_ids and attention_mask, as the model received them."""
    seen: list[dict[str, Any]] = []

    def hook(module: Any, args: tuple, kwargs: dict) -> None:
        mask = kwargs.get("attention_mask")
        seen.append({"positions": kwargs["position_ids"].clone(), "mask": None if mask is None else mask.clone()})

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def _run(name: str | None, model: str = "qwen3") -> tuple[loop.Rollout, list[dict[str, Any]]]:
    backend = ar_models.backend(model)
    applied = ablation.get(name).apply() if name else nullcontext()
    with applied, _forwards(backend.model) as seen:
        rollout = left_padded.fast_left_rollout(backend, _batch(), 3)
    return rollout, seen


def test_positions_from_a_shared_cache_position_place_every_row_at_the_width() -> None:
    catalogue.load()
    _, right = _run(None)
    _, wrong = _run("ar.left.positions_from_shared_cache_position")
    assert right[1]["positions"][:, 0].tolist() == list(LENGTHS)  # each row goes on where its prompt ends
    assert wrong[1]["positions"][:, 0].tolist() == [9, 9, 9]  # the batch's width, for every row
    assert torch.equal(right[0]["positions"], wrong[0]["positions"])  # the prefill is untouched


def test_pad_keys_visible_admits_each_rows_pad_columns_at_decode_only() -> None:
    catalogue.load()
    _, right = _run(None)
    _, wrong = _run("ar.left.pad_keys_visible")
    pads = [9 - n for n in LENGTHS]
    for row, p in enumerate(pads):
        assert not right[1]["mask"][row, 0, 0, :p].any() and wrong[1]["mask"][row, 0, 0, :p].all()
    assert torch.equal(right[1]["mask"][:, 0, 0, 9:], wrong[1]["mask"][:, 0, 0, 9:])  # the rest is the same
    assert torch.equal(right[0]["mask"], wrong[0]["mask"])


def test_the_mask_dropped_after_prefill_leaves_decode_steps_unmasked() -> None:
    catalogue.load()
    _, wrong = _run("ar.left.decode_mask_dropped")
    assert wrong[0]["mask"] is not None and all(f["mask"] is None for f in wrong[1:])


def test_positions_not_shifted_number_the_columns() -> None:
    catalogue.load()
    _, right = _run(None)
    _, wrong = _run("ar.left.positions_not_shifted")
    assert [row[9 - n:].tolist() for row, n in zip(right[0]["positions"], LENGTHS, strict=True)] == \
        [list(range(n)) for n in LENGTHS]
    assert (wrong[0]["positions"] == torch.arange(9)).all()


def test_first_logits_at_real_pos_reads_a_pad_or_prompt_column() -> None:
    catalogue.load()
    backend = ar_models.backend("qwen3")
    logits: list[torch.Tensor] = []
    handle = backend.model.register_forward_hook(lambda module, args, out: logits.append(out.logits.detach()))
    try:
        wrong, _ = _run("ar.left.first_logits_at_real_pos")
    finally:
        handle.remove()
    prefill = logits[0]
    expected = [int(prefill[row, n - 1].argmax()) for row, n in enumerate(LENGTHS)]
    assert wrong.tokens[:, 0].tolist() == expected  # column real_pos - 1: the right-padded layout's rule
    assert wrong.tokens[1, 0] == int(prefill[1, -1].argmax())  # the unpadded row is read right


# --------------------------------------------------------------------------------------------- the layout's pieces


def test_positions_count_real_tokens_and_put_each_pad_past_its_rows_prompt() -> None:
    mask = torch.tensor([[False, False, True, True, True], [True, True, True, True, True],
                         [False, False, False, False, True]])
    assert left_padded.left_positions(mask).tolist() == [[3, 4, 0, 1, 2], [0, 1, 2, 3, 4], [1, 2, 3, 4, 0]]


@pytest.mark.parametrize(("ids", "mask", "said"), [
    (torch.ones(2, 3, 1, dtype=torch.long), torch.ones(2, 3, 1, dtype=torch.bool), "input_ids \\[B, W\\]"),
    (torch.ones(2, 3, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool), "of the same shape"),
    (torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3), "a bool attention_mask"),
])
def test_a_batch_of_the_wrong_shape_or_mask_dtype_is_refused_alone(ids, mask, said) -> None:
    """Each defect on its own is refused (not only when all three coincide)."""
    with pytest.raises(ValueError, match=said):
        left_padded.fast_left_rollout(ar_models.backend("fake"), LeftPaddedBatch(ids, mask, PAD), 2)


def test_the_layout_of_a_layout_is_itself_and_each_backend_gets_its_contract() -> None:
    shared = left_padded.layout_for(ar_models.backend("qwen3"))
    assert isinstance(shared, left_padded.SharedColumns) and left_padded.layout_for(shared) is shared
    assert isinstance(left_padded.layout_for(ar_models.backend("fake")), left_padded.RowSlots)


def test_the_columns_handed_to_the_model_are_the_ones_each_forward_writes(monkeypatch) -> None:
    """Shared columns: the prefill writes columns [0, W), decode step k column W + k - 1, every row alike (what a
    cache that takes write slots is told; on a stack whose cache derives them itself they must agree too)."""
    handed: list[list[int]] = []
    run = left_padded.SharedColumns._run

    def spy(self, ids, mask, positions, cache, slots):
        handed.append(slots.tolist())
        return run(self, ids, mask, positions, cache, slots)

    monkeypatch.setattr(left_padded.SharedColumns, "_run", spy)
    batch = left_padded_batch(prompt_ids(LENGTHS, seed=71), PAD)
    left_padded.fast_left_rollout(ar_models.backend("qwen3"), batch, 4)
    width = batch.width
    assert handed == [list(range(width)), [width], [width + 1], [width + 2]]
