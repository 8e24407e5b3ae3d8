"""The mask rules, layout fields, contract report and mask-free control on layouts small enough to
count by hand."""

from __future__ import annotations

import pytest
import torch

from harness.attention import contract, masks, reference
from harness.attention.contract import ContractReport
from harness.attention.layout import AttentionLayout

pytestmark = pytest.mark.cpu

# Denoise Q 4 x KV 5: query rows at positions 1..4, the special row 1 sees keys {0, 1}, the span rows
# 2, 3, 4 see every key [0, 5).
DENOISE = AttentionLayout(2, 3, 1, "denoise")


def test_image_span_mask_is_the_span_rectangle_alone():
    pos = torch.arange(6)
    got = masks.image_span_mask(pos[:, None], pos[None, :], 2, 4)
    expected = torch.zeros(6, 6, dtype=torch.bool)
    expected[2:4, 2:4] = True
    assert torch.equal(got, expected)


def test_layout_special_positions_description_and_bounds():
    one_token, all_special = AttentionLayout(2, 1, 0, "prefill"), AttentionLayout(2, 3, 2, "denoise")
    assert (one_token.span, one_token.q_len, all_special.q_len, all_special.special_positions) == ((2, 3), 3, 5, (0, 2))
    with pytest.raises(ValueError, match="image span cannot be empty"):
        AttentionLayout(2, 0, 0, "prefill")
    with pytest.raises(ValueError, match=r"special_len must be <= text_len \(2\)"):
        AttentionLayout(2, 3, 3, "denoise")
    prefill, denoise = AttentionLayout(4, 6, 2, "prefill"), AttentionLayout(4, 6, 2, "denoise")
    assert (prefill.special_positions, denoise.special_positions) == ((10, 12), (2, 4))
    assert prefill.describe() == "prefill 4 text + 6 image + 2 special: Q 12 x KV 12, span [4, 10)"
    assert denoise.describe() == "denoise 4 text + 6 image + 2 special: Q 8 x KV 10, span [4, 10)"


def test_density_and_visibility_histogram_count_visible_keys_per_row():
    mask = contract.formula_mask(4, 4, (1, 3))  # rows see 1, 3, 3, 4 keys
    assert (contract.density(mask), contract.visibility_histogram(mask)) == (11 / 16, {1: 1, 3: 2, 4: 1})


def test_contract_report_of_a_denoise_mask_and_of_one_flipped_pair():
    mask = masks.build_mask(DENOISE)
    report = contract.verify_mask(mask)
    assert report == ContractReport(4, 5, None, (2, 5), 0, None, 17 / 20, {2: 1, 5: 3})
    assert (report.total, report.where()) == (20, "no mismatch")
    mask[0, 1] = False
    flipped = contract.verify_mask(mask, span=(2, 5))
    assert flipped == ContractReport(4, 5, (2, 5), (2, 5), 1, (0, 1), 16 / 20, {1: 1, 5: 3})
    assert (flipped.total, flipped.where()) == (20, "first mismatch at query row 0, key 1")


def _attention_fp64(q, k, v, visible: torch.Tensor, scale: float) -> torch.Tensor:
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v.double()


@pytest.mark.parametrize("layout", [AttentionLayout(2, 3, 1, "prefill"), DENOISE], ids=["prefill", "denoise"])
def test_mask_free_is_bottom_right_causal_attention(layout):
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, 2, layout.q_len, 8, generator=gen)
    k, v = (torch.randn(1, 2, layout.kv_len, 8, generator=gen) for _ in range(2))
    bottom_right = torch.ones(layout.q_len, layout.kv_len, dtype=torch.bool).tril(layout.kv_len - layout.q_len)
    got = reference.mask_free(q, k, v, layout, scale=0.25)
    torch.testing.assert_close(got.double(), _attention_fp64(q, k, v, bottom_right, 0.25))


def test_detect_span_finds_a_two_token_span():
    assert [contract.detect_span(contract.formula_mask(6, 6, span)) for span in ((2, 4), (2, 3), (1, 6))] == [
        (2, 4), None, (1, 6)]  # a one-token span looks causal


@pytest.mark.parametrize(("span", "match"), [
    ((2, 7), r"detected span \[2, 7\) does not fit 6 keys"), ((3, 3), r"detected span \[3, 3\) does not fit 6 keys"),
    ((4, 3), r"detected span \[4, 3\) does not fit 6 keys"), (None, "has no image span"),
])
def test_layout_for_refuses_a_span_that_does_not_fit(span, match):
    with pytest.raises(ValueError, match=match):
        contract.layout_for(6, 6, span)


@pytest.mark.parametrize("layout", [AttentionLayout(2, 3, 2, "prefill"), AttentionLayout(3, 3, 2, "denoise")],
                         ids=["prefill", "denoise"])
def test_the_special_row_rule_governs_exactly_the_special_rows(monkeypatch, layout):
    monkeypatch.setattr(masks, "special_row_visibility", lambda q, kv, start, end: (q - kv) > 10 ** 6)
    blind = (~masks.build_mask(layout).any(dim=-1)).nonzero().flatten() + layout.q_offset
    assert blind.tolist() == list(range(*layout.special_positions))


def test_check_inputs_names_the_one_mismatch():
    layout = AttentionLayout(2, 3, 1, "prefill")
    for bad, exc, match in (
            ({"key": torch.float16}, TypeError, "dtypes differ: torch.float32, torch.float16, torch.float32"),
            ({"value": torch.float16}, TypeError, "dtypes differ: torch.float32, torch.float32, torch.float16"),
            ({"batch": 2}, ValueError, r"query \(B=1, D=8\) and key \(B=2, D=8\) must share batch and head dim"),
            ({"dim": 4}, ValueError, r"query \(B=1, D=8\) and key \(B=1, D=4\) must share batch and head dim")):
        kv_shape = (bad.get("batch", 1), 2, layout.kv_len, bad.get("dim", 8))
        q = torch.zeros(1, 2, layout.q_len, 8)
        k = torch.zeros(kv_shape, dtype=bad.get("key", torch.float32))
        v = torch.zeros(kv_shape, dtype=bad.get("value", torch.float32))
        with pytest.raises(exc, match=match):
            reference.check_inputs(q, k, v, layout)


def test_the_default_scale_is_one_over_root_head_dim():
    q = torch.zeros(1, 1, 3, 16)
    assert (reference.resolve_scale(q, None), reference.resolve_scale(q, 2)) == (0.25, 2.0)
