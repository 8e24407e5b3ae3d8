"""Properties of the mask builder and the contract verifier over many layouts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fixtures.attention_strategies import edge_layouts, layouts, straddling_layouts
from harness.attention import contract, masks
from harness.attention.layout import AttentionLayout

pytestmark = pytest.mark.cpu

any_layout = st.one_of(layouts(), edge_layouts(), straddling_layouts().map(lambda case: case[0]))
detectable = st.one_of(layouts(min_image=2), edge_layouts(min_image=2),
                       straddling_layouts(min_image=2).map(lambda case: case[0]))


@settings(max_examples=40, deadline=None)
@given(any_layout)
def test_builder_agrees_with_formula(layout: AttentionLayout):
    mask = masks.build_mask(layout)
    assert mask.shape == (layout.q_len, layout.kv_len)
    report = contract.verify_mask(mask, layout.span, images=layout.images)
    assert report.mismatches == 0, f"{layout.describe()}: {report.mismatches} mismatches, {report.where()}"


@settings(max_examples=40, deadline=None)
@given(any_layout)
def test_every_row_sees_a_prefix_of_the_closed_form_length(layout: AttentionLayout):
    mask = masks.build_mask(layout)
    pos = torch.arange(layout.q_offset, layout.kv_len)
    expected = pos + 1
    for start, end in layout.spans:  # a row of any image span sees up to that span's end
        expected = torch.where((pos >= start) & (pos < end), torch.full_like(pos, end), expected)
    counts = contract.row_visibility(mask)
    assert torch.equal(counts.long(), expected)
    prefix = torch.arange(layout.kv_len)[None, :] < counts[:, None]
    assert torch.equal(mask, prefix)


@settings(max_examples=40, deadline=None)
@given(any_layout)
def test_density_and_histogram_account_for_every_pair(layout: AttentionLayout):
    report = contract.verify_mask(masks.build_mask(layout))
    assert sum(report.histogram.values()) == layout.q_len
    visible = sum(count * rows for count, rows in report.histogram.items())
    assert report.density == pytest.approx(visible / (layout.q_len * layout.kv_len), rel=1e-12)


@settings(max_examples=40, deadline=None)
@given(detectable)
def test_span_detection_round_trips(layout: AttentionLayout):
    mask = masks.build_mask(layout)
    assert contract.detect_span(mask) == layout.span
    detected = contract.detect_layout(mask)
    assert torch.equal(masks.build_mask(detected), mask), f"{layout.describe()} -> {detected.describe()}"
    if layout.phase == "prefill":
        assert detected == layout
    elif layout.q_offset > 0:  # earlier images lie in the prefix every denoise row sees: the mask cannot show them
        assert detected == dataclasses.replace(layout, images=())


@settings(max_examples=20, deadline=None)
@given(layouts(max_image=1, min_image=1, max_images=0))
def test_one_token_span_is_plain_causal(layout: AttentionLayout):
    mask = masks.build_mask(layout)
    assert torch.equal(mask, masks.causal_only(layout))
    assert contract.detect_span(mask) is None
    with pytest.raises(ValueError, match="no image span"):
        contract.detect_layout(mask)


@settings(max_examples=25, deadline=None)
@given(detectable, st.data())
def test_verifier_counts_and_locates_a_flipped_pair(layout: AttentionLayout, data):
    mask = masks.build_mask(layout).clone()
    row = data.draw(st.integers(0, layout.q_len - 1))
    key = data.draw(st.integers(0, layout.kv_len - 1))
    mask[row, key] = ~mask[row, key]
    report = contract.verify_mask(mask, layout.span, images=layout.images)
    assert report.mismatches == 1
    assert report.first_mismatch == (row, key)


def test_seed_layouts_have_the_seed_shapes():
    from harness.attention.layout import SEED_DENOISE, SEED_PREFILL

    assert (SEED_PREFILL.q_len, SEED_PREFILL.kv_len, SEED_PREFILL.span) == (5348, 5348, (1249, 5345))
    assert (SEED_DENOISE.q_len, SEED_DENOISE.kv_len, SEED_DENOISE.span) == (4099, 5345, (1249, 5345))
    assert SEED_PREFILL.kv_len % 128 == 100
    assert SEED_DENOISE.special_positions == (1246, 1249)


def test_batched_capture_mask_is_accepted_and_disagreeing_batches_are_named():
    layout = AttentionLayout(5, 6, 2, "prefill")
    mask = masks.build_mask(layout)[None, None].expand(2, 1, -1, -1).clone()
    assert contract.verify_mask(mask).mismatches == 0
    mask[1, 0, 0, 3] = True
    with pytest.raises(ValueError, match="batch entries"):
        contract.verify_mask(mask)


def test_a_mask_checked_without_a_span_brings_every_earlier_image_of_its_own():
    """With no span given, every detected span but the last is an earlier image of the formula: two of them here."""
    layout = AttentionLayout(40, 8, 1, "prefill", images=((4, 10), (20, 28)))
    report = contract.verify_mask(masks.build_mask(layout))
    assert (report.mismatches, report.detected_images, report.detected_span) == (0, ((4, 10), (20, 28)), layout.span)
