"""Every kernel against the masked-SDPA reference over layouts, block sizes, heads and GQA groups."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask

from fixtures.attention_captures import small_capture
from fixtures.attention_strategies import (
    KernelCase,
    block_sizes,
    edge_layouts,
    kernel_cases,
    layouts,
    straddling_layouts,
)
from harness.attention import contract, decomposed, flex, judge, kernels, masks, padded, primitives, reference, spy
from harness.attention.layout import AttentionLayout
from harness.judging.compare import close

pytestmark = pytest.mark.cpu

# fp32 kernels summing the same products in another order: torch.testing's fp32 defaults.
FP32 = close(reason="fp32 torch.testing defaults: same products, another summation order")


def _run(case: KernelCase, name: str) -> torch.Tensor:
    capture = small_capture(case.layout, heads=case.heads, kv_heads=case.kv_heads, head_dim=case.head_dim,
                            seed=case.seed)
    q, k, v = capture.heads_first()
    fn = {"sdpa": reference.masked_sdpa, "decomposed": decomposed.decomposed}.get(name)
    if fn is not None:
        return fn(q, k, v, case.layout, scale=capture.scale)
    fn = {"flex": flex.flex_structured, "block_padded": padded.block_padded}[name]
    return fn(q, k, v, case.layout, scale=capture.scale, block=case.block)


@settings(max_examples=15, deadline=None)
@given(kernel_cases())
def test_kernels_match_masked_sdpa_on_the_capture_mask(case: KernelCase):
    capture = small_capture(case.layout, heads=case.heads, kv_heads=case.kv_heads, head_dim=case.head_dim,
                            seed=case.seed)
    expected = judge.reference_output(capture)
    for name in ("sdpa", "decomposed", "flex", "block_padded"):
        verdict = FP32.judge(_run(case, name), expected, dims=judge.OUTPUT_DIMS,
                             what=f"{name} on {case.layout.describe()} block {case.block}")
        assert verdict.passed, verdict.describe()


@settings(max_examples=25, deadline=None)
@given(st.one_of(straddling_layouts(), st.tuples(layouts(), block_sizes)))
def test_block_mask_matches_create_block_mask(case: tuple[AttentionLayout, int]):
    layout, block = case
    mine = flex.block_mask_for(layout, block=block)
    theirs = create_block_mask(flex.mask_mod_for(layout), None, None, layout.q_len, layout.kv_len, device="cpu",
                               BLOCK_SIZE=block)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(mine, name), getattr(theirs, name)), f"{name} differs for {layout.describe()}"
    cover = kernels.block_coverage(mine, masks.build_mask(layout))
    assert cover["skipped_visible_tiles"] == 0 and cover["false_full_tiles"] == 0


@settings(max_examples=40, deadline=None)
@given(st.one_of(straddling_layouts(), st.tuples(layouts(), block_sizes)))
def test_pad_mask_keeps_pad_keys_invisible_and_pad_rows_defined(case: tuple[AttentionLayout, int]):
    layout, block = case
    mask = masks.build_mask(layout)
    q_pad, kv_pad = padded.padded_length(layout.q_len, block), padded.padded_length(layout.kv_len, block)
    out = padded.pad_mask(mask, q_pad, kv_pad)
    assert q_pad % block == 0 and kv_pad % block == 0
    assert torch.equal(out[:layout.q_len, :layout.kv_len], mask)
    assert not out[:layout.q_len, layout.kv_len:].any()
    assert out[layout.q_len:].any(dim=-1).all()


@settings(max_examples=40, deadline=None)
@given(st.one_of(layouts(), edge_layouts()))
def test_split_rows_partitions_rows_into_prefix_blocks(layout: AttentionLayout):
    mask = masks.build_mask(layout)
    blocks = decomposed.split_rows(layout)
    # the blocks own every dense pair exactly when the mask is dense (what the launch proof's "fewer than dense
    # unless the mask is dense" rests on)
    assert (sum(b.pairs for b in blocks) == layout.q_len * layout.kv_len) == bool(mask.all()), layout.describe()
    assert [b.start for b in blocks] == [0] + [b.stop for b in blocks[:-1]]
    assert blocks[-1].stop == layout.q_len
    for block in blocks:
        rows = mask[block.start:block.stop]
        assert not rows[:, block.kv_stop:].any()
        inner = rows[:, :block.kv_stop]
        if block.causal:
            lower_right = torch.ones(block.rows, block.kv_stop, dtype=torch.bool).tril(block.kv_stop - block.rows)
            assert torch.equal(inner, lower_right)
        else:
            assert inner.all()


@settings(max_examples=15, deadline=None)
@given(kernel_cases())
def test_decomposed_launches_one_unmasked_or_causal_sdpa_per_block(case: KernelCase):
    with spy.recording() as launches:
        _run(case, "decomposed")
    blocks = decomposed.split_rows(case.layout)
    assert [launch.rows for launch in launches] == [b.rows for b in blocks]
    assert {launch.mask for launch in launches} <= {"none", "causal_bias"}
    assert all(launch.kv_shape[1] == case.kv_heads for launch in launches)


def test_mask_free_is_far_from_the_reference_on_a_small_layout():
    layout = AttentionLayout(6, 20, 2, "prefill")
    capture = small_capture(layout, heads=2, head_dim=16, seed=3)
    q, k, v = capture.heads_first()
    gap = (reference.mask_free(q, k, v, layout) - judge.reference_output(capture)).abs().max()
    assert gap > 1e-2
    assert contract.verify_mask(masks.causal_only(layout), layout.span).mismatches > 0


def test_the_launch_spy_keeps_sdpa_s_own_defaults():
    """A kernel that leaves attn_mask and is_causal out launches plain full attention, recorded or not, and the spy
    says so."""
    q, k, v = torch.randn(3, 1, 2, 5, 4, generator=torch.Generator().manual_seed(0)).unbind(0)
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.5)
    assert torch.equal(primitives.launch_sdpa(q, k, v, scale=0.5, enable_gqa=False), full)  # no spy in between
    with spy.recording() as launches:
        out = primitives.launch_sdpa(q, k, v, scale=0.5, enable_gqa=False)
    assert [launch.mask for launch in launches] == ["none"]
    assert torch.equal(out, full)


def test_every_kernel_computes_at_the_scale_the_seam_resolves(monkeypatch):
    """The kernels look the scale up through ``reference.resolve_scale`` at call time (an ablation there reaches
    every one), are handed the scale they were called with, and compute at what it returns."""
    layout = AttentionLayout(10, 24, 2, "prefill", images=((2, 6),))
    capture = small_capture(layout, heads=4, kv_heads=2, head_dim=8, batch=2, seed=5)
    q, k, v = capture.heads_first()
    asked = []

    def resolve_scale(query, scale):
        asked.append(scale)
        return 0.7

    monkeypatch.setattr(reference, "resolve_scale", resolve_scale)
    expected = judge.reference_output(capture.__class__(capture.query, capture.key, capture.value, capture.mask,
                                                        scale=0.7))
    for name in ("decomposed", "flex", "block_padded"):
        asked.clear()
        out = kernels.get_kernel(name)(q, k, v, layout, scale=0.2)
        assert asked == [0.2], name
        verdict = FP32.judge(out, expected, dims=judge.OUTPUT_DIMS, what=f"{name} at the resolved scale")
        assert verdict.passed, verdict.describe()


def test_the_reference_never_launches_through_the_kernels_primitives(monkeypatch):
    """A bug in the launches the kernels share moves the kernels, never the reference they are judged against."""
    layout = AttentionLayout(5, 12, 2, "denoise")
    capture = small_capture(layout, heads=4, kv_heads=2, head_dim=8, batch=2, seed=6)
    q, k, v = capture.heads_first()
    kv = reference.expand_kv(k, 4), reference.expand_kv(v, 4)
    expected = torch.nn.functional.scaled_dot_product_attention(q, *kv, attn_mask=capture.mask, scale=capture.scale)

    def broken(*args, **kwargs):
        raise AssertionError("the reference went through harness.attention.primitives")

    for seam in ("sdpa", "gqa_operands", "launch_sdpa"):
        monkeypatch.setattr(primitives, seam, broken)
    assert torch.equal(judge.reference_output(capture), expected)
    assert judge.reference_output(capture, torch.float64).dtype == torch.float64


def test_the_decomposed_proof_holds_a_kernel_to_its_blocks_pairs_even_below_the_dense_count():
    """Launches that compute more pairs than the row blocks own fail the proof, though still fewer than dense."""
    from types import SimpleNamespace

    layout = AttentionLayout(7, 12, 3, "prefill")
    blocks = decomposed.split_rows(layout)
    mask = torch.zeros(1, 1, layout.q_len, layout.kv_len, dtype=torch.bool)

    def launches(extra_keys: int) -> list[SimpleNamespace]:
        return [SimpleNamespace(rows=b.rows, keys=b.kv_stop + (extra_keys if i == 0 else 0),
                                mask="none" if i else "causal_bias", primitive="sdpa") for i, b in enumerate(blocks)]

    exact_facts = kernels._decomposed_proof(launches(0), layout, mask, None)
    wider_facts = kernels._decomposed_proof(launches(1), layout, mask, None)
    assert exact_facts[3][0], exact_facts[3]
    assert wider_facts[3][2]["pairs"] < wider_facts[3][2]["dense_pairs"]
    assert not wider_facts[3][0], wider_facts[3]
