"""A failing batched forward's rows traced back to the stock forwards' rows: a tiling nested the wrong way is named,
a right layout or a row no stock forward had is left to the numbers."""

from __future__ import annotations

import itertools

import pytest
import torch

from harness.replay.diagnosis import row_layout

pytestmark = pytest.mark.cpu

B, TARGET, BRANCHES = 2, (0, 3, 4), ("cond", "uncond")


def _fields(rows: list[tuple[int, int, int]]) -> dict[str, torch.Tensor]:
    """Rows of a forward: ``ids`` carry the (branch, sample) conditions, ``x`` the (step, sample) latents."""
    ids = torch.tensor([[10.0 * b + k, 1.0] for b, _, k in rows])
    x = torch.tensor([[100.0 * s + k] * 3 for _, s, k in rows], dtype=torch.bfloat16)
    return {"encoder_hidden_states": ids, "hidden_states": x}


def _serial() -> list[dict[str, torch.Tensor]]:
    return [_fields([(b, s, k) for b in range(2) for k in range(B)]) for s in range(len(TARGET))]


def _batched(order: tuple[str, ...]) -> dict[str, torch.Tensor]:
    sizes = {"branch": 2, "step": len(TARGET), "sample": B}
    rows = []
    for place in itertools.product(*(range(sizes[n]) for n in order)):
        named = dict(zip(order, place, strict=True))
        rows.append((named["branch"], named["step"], named["sample"]))
    return _fields(rows)


def test_the_right_layout_is_not_a_diagnosis():
    assert row_layout(_serial(), _batched(("branch", "step", "sample")), TARGET, BRANCHES, B) is None


def test_conditions_tiled_step_major_outside_the_branches_are_named():
    """The bug as it ships: the fused conditions repeated whole ([c, u, c, u, ...]) beside step-major latents."""
    rows = []
    for r in range(2 * len(TARGET) * B):
        branch, sample = (r // B) % 2, r % B
        step = (r % (len(TARGET) * B)) // B
        rows.append((branch, step, sample))
    found = row_layout(_serial(), _fields(rows), TARGET, BRANCHES, B)
    assert found is not None and "the conditions were tiled step-major outside the branches" in found
    assert "[cond_s0, uncond_s0, cond_s1, ...]" in found and "midpoint split mixes the CFG branches" in found
    assert "row 2 holds uncond step 3 sample 0" in found  # where the first wrong rows are, in the path's words
    assert found.endswith(")") and found[found.rindex("("):].count("row ") == 3  # the first three, of more


def test_a_whole_batch_nested_step_major_names_the_branches():
    found = row_layout(_serial(), _batched(("step", "branch", "sample")), TARGET, BRANCHES, B)
    assert found is not None and "the CFG branches alternate every B rows" in found


def test_inputs_that_carry_gradients_are_traced_too():
    """A replay under training computes with gradients: conditions from a text encoder that is learning."""
    serial, batched = _serial(), _batched(("step", "branch", "sample"))
    for inputs in (*serial, batched):
        inputs["encoder_hidden_states"].requires_grad_(True)
    found = row_layout(serial, batched, TARGET, BRANCHES, B)
    assert found is not None and "the CFG branches alternate every B rows" in found


def test_steps_repeated_in_place_per_sample_are_named():
    found = row_layout(_serial(), _batched(("branch", "sample", "step")), TARGET, BRANCHES, B)
    assert found is not None and "each sample's S steps are adjacent (repeat_interleave)" in found


def test_any_other_nesting_is_described_by_its_order():
    found = row_layout(_serial(), _batched(("sample", "step", "branch")), TARGET, BRANCHES, B)
    assert found is not None
    assert "the CFG branches run, from row 1, uncond, cond, uncond, cond, uncond, cond, uncond, cond, ... where the " \
           "stack holds cond, cond, cond, cond, cond, uncond, uncond, uncond, ..." in found


@pytest.mark.parametrize("change", ["a field no stock row has", "another argument set", "a step fewer", "a step more",
                                    "the same bytes in another dtype", "the same bytes in another shape"])
def test_rows_that_cannot_be_traced_are_left_to_the_numbers(change):
    serial, batched = _serial(), _batched(("step", "branch", "sample"))
    if change == "a field no stock row has":
        batched["encoder_hidden_states"] = batched["encoder_hidden_states"] + 0.5
    elif change == "another argument set":
        batched["pooled_projections"] = batched["encoder_hidden_states"]
    elif change == "a step fewer":
        serial = serial[:-1]
    elif change == "a step more":  # stock forwards the targets do not account for
        serial = [*serial, serial[0]]
    elif change == "the same bytes in another dtype":
        batched["hidden_states"] = batched["hidden_states"].view(torch.int16)
    else:
        batched["hidden_states"] = batched["hidden_states"][..., None]
    assert row_layout(serial, batched, TARGET, BRANCHES, B) is None


def test_one_branch_has_no_branch_order_to_get_wrong():
    serial = [_fields([(0, s, k) for k in range(B)]) for s in range(len(TARGET))]
    batched = _fields([(0, s, k) for s in range(len(TARGET)) for k in range(B)])
    assert row_layout(serial, batched, TARGET, ("cond",), B) is None


def test_a_failing_batched_replay_is_headed_by_the_row_layout_that_names_its_bug(parity_ctx):
    """The check's verdict carries the diagnosis only when it fails: passing, it is left as it is."""
    from harness.judging import ablation, catalogue, checks

    catalogue.load()
    passed = checks.run_check("replay.cfg2.log_probs", parity_ctx)
    assert passed.passed and "row_layout" not in passed.metrics, passed.describe()
    with ablation.get("replay.nesting_swapped").apply():
        failed = checks.run_check("replay.cfg2.log_probs", parity_ctx)
    assert not failed.passed and "row_layout" in failed.metrics
    assert failed.message.startswith(failed.metrics["row_layout"]), failed.message
    assert failed.message.startswith("the batched forward's rows are stock rows in the wrong places")
    assert "uncond" in failed.metrics["row_layout"]  # the window opens where the branches first differ
