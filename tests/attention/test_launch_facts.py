"""Each kernel's launch facts fail when exactly one part of them is violated; the BlockMask tile audit
and the pair counts on hand-counted layouts; how the primitives hand key/value to a launch."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from harness.attention import capture, decomposed, flex, judge, kernels, masks, padded, primitives
from harness.attention.decomposed import RowBlock
from harness.attention.layout import AttentionLayout
from harness.attention.spy import Launch
from harness.plugins import entry_points as plugins

pytestmark = pytest.mark.cpu

# Q 6 x KV 6: text [0, 2), image [2, 5), special 5.  Denoise: Q 4 x KV 5, rows at positions 1..4.
PREFILL = AttentionLayout(2, 3, 1, "prefill")
DENOISE = AttentionLayout(2, 3, 1, "denoise")
# Q 4 x KV 4 with span [1, 3): row visibility 1, 3, 3, 4; at block 2 tiles (0,0) (0,1) (1,1) partial, (1,0) full.
SMALL = AttentionLayout(1, 2, 1, "prefill")


def _facts(kernel: str, launches, layout=PREFILL, block=4):
    facts = kernels.KERNELS[kernel].proof(launches, layout, masks.build_mask(layout), block)
    return {text: ok for ok, text, _ in facts}


def _sdpa(rows, keys, mask, mask_shape=(), heads=2, kv_heads=2):
    return Launch("sdpa", (1, heads, rows, 8), (1, kv_heads, keys, 8), mask, mask_shape)


DENSE = "the launch carries the dense (Q, KV) bool mask"


@pytest.mark.parametrize(("launches", "holds"), [
    ([_sdpa(6, 6, "bool", (6, 6))], True),
    ([_sdpa(6, 6, "bool", (1, 1, 6, 6))], True),  # a capture's (B, 1, Q, KV) mask is dense too
    ([_sdpa(6, 6, "bool", (6, 5))], False),  # a bool mask of the wrong shape
    ([_sdpa(6, 6, "additive", (6, 6))], False),  # the right shape, not a bool mask
    ([], False),
])
def test_sdpa_fact_needs_a_bool_mask_of_the_full_shape(launches, holds):
    assert _facts("sdpa", launches) == {"exactly one sdpa launch": len(launches) == 1, DENSE: holds}


def _decomposed_launches(rows=(2, 3, 1), kinds=("causal_bias", "none", "causal_bias")):
    keys = {2: 2, 3: 5, 1: 6}
    return [_sdpa(r, keys[r], kind) for r, kind in zip(rows, kinds, strict=True)]


def test_decomposed_facts_hold_for_its_own_launches_and_fail_one_at_a_time():
    order, free, fewer = ("launch rows partition the query rows in order",
                          "no dense mask is materialised and the span rows run unmasked",
                          "computes only its row blocks' pairs: fewer than the dense reference unless the mask is "
                          "dense")
    assert [(b.start, b.stop, b.kv_stop, b.causal, b.pairs) for b in decomposed.split_rows(PREFILL)] == [
        (0, 2, 2, True, 4), (2, 5, 5, False, 15), (5, 6, 6, True, 6)]
    assert kernels.KERNELS["decomposed"].pairs(PREFILL, 128) == 25
    assert all(_facts("decomposed", _decomposed_launches()).values())
    reordered = _facts("decomposed", _decomposed_launches(rows=(3, 2, 1)))  # the right rows in the wrong order
    assert [text for text, ok in reordered.items() if not ok] == [order]
    masked = _facts("decomposed", _decomposed_launches(kinds=("causal_bias", "none", "bool")))
    assert [text for text, ok in masked.items() if not ok] == [free]
    all_causal = _facts("decomposed", _decomposed_launches(kinds=("causal_bias",) * 3))
    assert [text for text, ok in all_causal.items() if not ok] == [free]
    assert not _facts("decomposed", [_sdpa(6, 6, "none")] * 3)[fewer]
    dense_pairs = _facts("decomposed", [_sdpa(2, 6, "causal_bias"), _sdpa(3, 6, "none"), _sdpa(1, 6, "causal_bias")])
    assert [text for text, ok in dense_pairs.items() if not ok] == [fewer]  # 36 pairs: no fewer than dense
    # dense but valid layouts (image-only prefill; denoise without special rows): one unmasked block of all pairs
    for layout in (AttentionLayout(0, 4, 0, "prefill"), AttentionLayout(2, 3, 0, "denoise")):
        facts = _facts("decomposed", [_sdpa(layout.q_len, layout.kv_len, "none")], layout)
        assert all(facts.values()), (layout.describe(), facts)
    flexed = _decomposed_launches()
    flexed[1] = dataclasses.replace(flexed[1], primitive="flex")
    assert [text for text, ok in _facts("decomposed", flexed).items() if not ok] == ["one sdpa launch per row block"]
    metrics = [m for _, _, m in kernels.KERNELS["decomposed"].proof(
        [_sdpa(2, 3, "causal_bias"), _sdpa(2, 5, "none")], DENOISE, masks.build_mask(DENOISE), 4)]
    assert metrics == [{"launches": 2, "row_blocks": 2}, {"launch_rows": [2, 2]}, {"mask_kinds": "causal_bias,none"},
                       {"pairs": 16, "dense_pairs": 20}]


@pytest.mark.parametrize(("blocks", "match"), [
    ((RowBlock(0, 0, 1, True), RowBlock(0, 6, 6, False)), "into non-empty blocks"),  # an empty block
    ((RowBlock(0, 6, 0, False),), "into non-empty blocks"),  # a block that sees no key
    ((RowBlock(0, 6, 7, False),), "within 6 keys"),  # a block past the keys
    ((RowBlock(0, 2, 2, True), RowBlock(3, 6, 6, True)), "do not partition"),  # a gap
    ((RowBlock(0, 2, 2, True),), "cover 2 of 6 query rows"),
])
def test_decomposed_refuses_row_blocks_that_do_not_partition_the_rows(monkeypatch, blocks, match):
    monkeypatch.setattr(decomposed, "split_rows", lambda layout: blocks)
    q = torch.zeros(1, 1, 6, 4)
    with pytest.raises(ValueError, match=match):
        decomposed.decomposed(q, q, q, PREFILL)


PADDED = "the launch runs block-aligned (4) lengths under a bool mask"
CAUSAL = "the launch is causal only (no structured mask)"


@pytest.mark.parametrize(("launch", "holds"), [
    (_sdpa(8, 8, "bool", (8, 8)), True),
    (_sdpa(8, 8, "none"), False),  # aligned lengths, no mask
    (_sdpa(6, 8, "bool", (6, 8)), False),  # a mask, rows not padded
])
def test_padded_fact_needs_aligned_lengths_and_a_bool_mask(launch, holds):
    assert _facts("block_padded", [launch])[PADDED] is holds


@pytest.mark.parametrize(("launches", "holds"), [
    ([_sdpa(6, 6, "is_causal")], True), ([_sdpa(6, 6, "causal_bias")], True),
    ([_sdpa(6, 6, "bool", (6, 6))], False), ([], False),
])
def test_mask_free_fact_needs_a_causal_only_launch(launches, holds):
    assert _facts("mask_free", launches)[CAUSAL] is holds


def _flex_launch(layout, block_mask, shape=None):
    return Launch("flex", (1, 2, layout.q_len, 8), (1, 2, layout.kv_len, 8), "block_mask",
                  shape or tuple(block_mask.shape), block_mask)


COVERS = "the BlockMask covers every visible pair and declares no masked tile full"


def test_flex_facts_audit_the_launched_block_mask():
    own = flex.block_mask_for(SMALL, block=2)
    assert _facts("flex", [_flex_launch(SMALL, own)], SMALL, 2) == {
        "exactly one flex launch": True, "the BlockMask tiles are 2 x 2": True, COVERS: True}
    causal = create_block_mask(lambda b, h, q, kv: kv <= q, None, None, 4, 4, device="cpu", BLOCK_SIZE=2)
    assert _facts("flex", [_flex_launch(SMALL, causal)], SMALL, 2)[COVERS] is False  # skips the span's tile
    assert _facts("flex", [_flex_launch(SMALL, own, shape=(1, 1, 4, 3))], SMALL, 2)[COVERS] is False
    assert _facts("flex", [_flex_launch(SMALL, own)], SMALL, 4)["the BlockMask tiles are 4 x 4"] is False
    bare = Launch("flex", (1, 2, 4, 8), (1, 2, 4, 8), "block_mask", (1, 1, 4, 4), None)
    assert _facts("flex", [bare], SMALL, 2) == {"exactly one flex launch": True}


def _with_indices(block_mask: BlockMask, kv_indices: torch.Tensor, full_indices: torch.Tensor) -> BlockMask:
    return BlockMask.from_kv_blocks(block_mask.kv_num_blocks, kv_indices, block_mask.full_kv_num_blocks,
                                    full_indices, BLOCK_SIZE=block_mask.BLOCK_SIZE, mask_mod=block_mask.mask_mod,
                                    seq_lengths=block_mask.seq_lengths)


def test_block_coverage_counts_tiles_and_ignores_padding_slots():
    mask = masks.build_mask(SMALL)
    own = flex.block_mask_for(SMALL, block=2)
    clean = {"skipped_visible_tiles": 0, "false_full_tiles": 0, "computed_tiles": 4, "tiles": 4}
    assert kernels.block_coverage(own, mask) == clean
    # rows hold 2 partial / 1 full slots in use: the unused slots may hold anything (here 0, or out of range)
    for pad in (0, 2):
        kv_idx, full_idx = own.kv_indices.clone(), own.full_kv_indices.clone()
        kv_idx[..., 1, 1] = pad
        full_idx[..., 0, :] = pad
        assert kernels.block_coverage(_with_indices(own, kv_idx, full_idx), mask) == clean, pad
    # a causal BlockMask skips the tile (0, 1) where row 1 sees key 2; an all-visible one declares the three
    # tiles other than (1, 0) full
    causal = create_block_mask(lambda b, h, q, kv: kv <= q, None, None, 4, 4, device="cpu", BLOCK_SIZE=2)
    everything = create_block_mask(lambda b, h, q, kv: kv >= 0, None, None, 4, 4, device="cpu", BLOCK_SIZE=2)
    assert [kernels.block_coverage(bm, mask) for bm in (causal, everything)] == [
        {"skipped_visible_tiles": 1, "false_full_tiles": 0, "computed_tiles": 3, "tiles": 4},
        {"skipped_visible_tiles": 0, "false_full_tiles": 3, "computed_tiles": 4, "tiles": 4}]
    denoise = AttentionLayout(2, 3, 1, "denoise")  # Q 4 x KV 5 at block 2: 2 x 3 tiles
    assert kernels.block_coverage(flex.block_mask_for(denoise, block=2), masks.build_mask(denoise))["tiles"] == 6


def test_block_coverage_reads_rectangular_tiles():
    layout = AttentionLayout(3, 6, 2, "prefill")  # Q 11 x KV 11
    theirs = create_block_mask(flex.mask_mod_for(layout), None, None, 11, 11, device="cpu", BLOCK_SIZE=(4, 2))
    cover = kernels.block_coverage(theirs, masks.build_mask(layout))
    assert cover == {"skipped_visible_tiles": 0, "false_full_tiles": 0, "computed_tiles": int(
        theirs.kv_num_blocks.sum() + theirs.full_kv_num_blocks.sum()), "tiles": 3 * 6}


def test_flex_pairs_count_the_computed_tiles():
    assert kernels.KERNELS["flex"].pairs(SMALL, 2) == 16  # 3 partial + 1 full tiles of 2 x 2
    assert kernels.KERNELS["flex"].pairs(PREFILL, 2) == 28  # 3 partial + 4 full of 3 x 3 tiles (2 skipped)


@pytest.mark.parametrize(("heads", "kv_heads", "q_len", "kv_len", "gqa"), [
    (2, 2, 3, 5, False),  # equal heads; Q and KV lengths unlike any head count
    (2, 1, 1, 2, True),  # GQA where Q equals the key/value heads and KV the query heads
    (4, 2, 2, 4, True),
])
def test_gqa_operands_pass_compressed_heads_and_flag_the_group_broadcast(heads, kv_heads, q_len, kv_len, gqa):
    q, k, v = torch.zeros(1, heads, q_len, 8), torch.zeros(1, kv_heads, kv_len, 8), torch.ones(1, kv_heads, kv_len, 8)
    key, value, flag = primitives.gqa_operands(q, k, v)
    assert (key is k, value is v, flag) == (True, True, gqa)


def test_flex_runs_eagerly_on_cpu_and_compiled_with_static_shapes_on_cuda(monkeypatch):
    eager: list[dict] = []
    compiled: list[tuple] = []

    def fake_flex(query, key, value, **kwargs):
        eager.append(kwargs)
        return query

    def fake_compile(fn, **options):
        compiled.append((fn, options))
        return fn

    monkeypatch.setattr(primitives, "_compiled_flex", lambda: pytest.fail("the CPU path must not compile"))
    monkeypatch.setattr(primitives, "flex_attention", fake_flex)
    q = torch.zeros(1, 2, 4, 8)
    block_mask = flex.block_mask_for(SMALL, block=2)
    assert primitives.launch_flex(q, q, q, block_mask=block_mask, scale=0.5, enable_gqa=True) is q
    assert eager == [{"block_mask": block_mask, "scale": 0.5, "enable_gqa": True}]
    on_cuda = SimpleNamespace(is_cuda=True)  # stands in for a CUDA query: only the dispatch reads it
    monkeypatch.setattr(primitives, "_compiled_flex", lambda: fake_flex)
    assert primitives.launch_flex(on_cuda, q, q, block_mask=block_mask, scale=0.25, enable_gqa=False) is on_cuda
    assert eager[1:] == [{"block_mask": block_mask, "scale": 0.25, "enable_gqa": False}]
    monkeypatch.undo()
    monkeypatch.setattr(torch, "compile", fake_compile)
    assert primitives._compiled_flex.__wrapped__() is flex_attention
    assert compiled == [(flex_attention, {"dynamic": False})]


def test_one_default_block_of_128_everywhere():
    defaults = {fn.__name__: inspect.signature(fn).parameters["block"].default
                for fn in (flex.flex_structured, flex.block_mask_for, padded.block_padded, padded.padded_length,
                           judge.compare_kernel, kernels.KernelSpec.bind)}
    assert defaults == dict.fromkeys(defaults, kernels.BLOCK) and kernels.BLOCK == 128
    assert flex.block_mask_for(SMALL).BLOCK_SIZE == (128, 128)


@pytest.mark.parametrize("check", [kernels.check_block, lambda block: padded.padded_length(5, block) and block])
def test_a_block_is_a_positive_int(check):
    assert [check(1), check(2), check(64)] == [1, 2, 64]
    for bad in (0, -128, True, 2.0, "128"):
        with pytest.raises(ValueError, match="block size must be a positive int"):
            check(bad)


def test_padded_lengths_round_up_to_the_block():
    assert [padded.padded_length(n, b) for n, b in ((5, 1), (5, 4), (8, 4), (0, 4), (5348, 128))] == [5, 8, 8, 0, 5376]


def _undocumented(query, key, value, layout, *, scale=None):
    return query


def _documented(query, key, value, layout, *, scale=None):
    """My kernel.

    More text."""
    return query


def test_a_bare_callable_is_judged_on_its_numbers_with_dense_pairs_and_no_launch_facts():
    specs = [kernels.KernelSpec.from_callable(name, fn) for name, fn in (("a", _documented), ("b", _undocumented))]
    assert [(s.name, s.fn, s.gqa, s.doc, s.blocked, s.under_test, s.records_launches) for s in specs] == [
        ("a", _documented, True, "My kernel.", False, True, False),
        ("b", _undocumented, True, "b", False, True, False)]
    assert [specs[0].pairs(DENOISE, 128), specs[0].proof([_sdpa(4, 5, "none")], DENOISE, None, 128)] == [20, []]


class _Plugins:
    def __init__(self):
        self.ATTENTION_KERNELS = plugins.Registry("attention kernel", "register one")
        self.CHECKPOINT_KINDS = plugins.Registry("checkpoint kind", "register one")


def test_register_fills_a_plugin_module_and_get_kernel_registers_first(monkeypatch):
    fresh = _Plugins()
    kernels.register(fresh)
    assert {name: fresh.ATTENTION_KERNELS.get(name) for name in fresh.ATTENTION_KERNELS.names()} == kernels.KERNELS
    assert fresh.ATTENTION_KERNELS.origin("flex") == kernels.ORIGIN
    assert fresh.CHECKPOINT_KINDS.names() == [capture.CAPTURE_KIND.name]
    empty = _Plugins()
    monkeypatch.setattr(kernels, "plugins", empty)
    assert kernels.get_kernel("decomposed") is kernels.KERNELS["decomposed"]
    assert sorted(empty.ATTENTION_KERNELS.names()) == sorted(kernels.KERNELS)


def test_eager_flex_on_cpu_keeps_the_no_compile_warning_quiet(monkeypatch):
    def warning_flex(query, key, value, **kwargs):
        warnings.warn("flex_attention called without torch.compile() - this will use an unfused implementation",
                      UserWarning, stacklevel=2)
        return query

    monkeypatch.setattr(primitives, "flex_attention", warning_flex)
    q = torch.zeros(1, 1, 4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        primitives.launch_flex(q, q, q, block_mask=flex.block_mask_for(SMALL, block=2), scale=1.0, enable_gqa=False)
    assert [str(w.message) for w in caught] == []
