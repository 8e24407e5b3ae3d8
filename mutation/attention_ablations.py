"""Ablations of the attention path: known bugs re-introduced over its seams.

Kill modes: a bug that changes numbers is caught by the numbers ("tolerance") on every kernel check
it claims; the contract checks (mask vs formula, density, histogram, span detection) and launch
proofs (GQA heads at the launch, block-aligned lengths) are facts by nature ("fact").

The input-space bugs (a dropped scale, the batch and head axes flattened apart, a hard-coded GQA group) each hide
on every input outside one class, so each claims exactly the space checks of its class
(``fixtures.attention_space``: computed from the drawn points).
"""

from __future__ import annotations

import dataclasses

import torch

from fixtures.attention_captures import INPUT_CASES
from fixtures.attention_space import ids_where
from harness.attention import kernels, masks, padded
from harness.attention.decomposed import RowBlock
from harness.attention.layout import AttentionLayout
from harness.judging.ablation import ablation
from harness.judging.checkid import CheckId


def _span_end_early(original):
    def span_bounds(layout: AttentionLayout) -> tuple[int, int]:
        start, end = original(layout)
        return start, end - 1

    return span_bounds


def _span_start_late(original):
    def span_bounds(layout: AttentionLayout) -> tuple[int, int]:
        start, end = original(layout)
        return start + 1, end

    return span_bounds


def _causal_only_mask(layout: AttentionLayout, device=None) -> torch.Tensor:
    return masks.causal_only(layout, device)


def _pad_keys_visible(original):
    def pad_mask(mask: torch.Tensor, q_pad: int, kv_pad: int) -> torch.Tensor:
        out = original(mask, q_pad, kv_pad)
        out[:, mask.shape[1]:] = True
        return out

    return pad_mask


def _split_one_row_late(original):
    def split_rows(layout: AttentionLayout) -> tuple[RowBlock, ...]:
        blocks = list(original(layout))
        at = next(i for i, b in enumerate(blocks) if not b.causal)
        span = blocks[at]
        if at and blocks[at - 1].causal:
            before = blocks[at - 1]
            blocks[at - 1] = dataclasses.replace(before, stop=before.stop + 1, kv_stop=before.kv_stop + 1)
        else:
            blocks.insert(at, RowBlock(span.start, span.start + 1, layout.q_offset + span.start + 1, True))
            at += 1
        blocks[at] = dataclasses.replace(span, start=span.start + 1)
        return tuple(b for b in blocks if b.rows > 0)

    return split_rows


def _kv_expanded_before_launch(query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    group = query.shape[1] // key.shape[1]
    return key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1), False


def _seed_block_always(original):
    def padded_length(length: int, block: int = padded.BLOCK) -> int:
        return original(length, padded.BLOCK)

    return padded_length


def _default_scale_always(query: torch.Tensor, scale: float | None) -> float:
    return query.shape[-1] ** -0.5


def _head_major(tensor: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, ...) flattened batch-major, read back head-major: slot (b, g) holds flat row g * B + b."""
    batch, heads, *rest = tensor.shape
    return tensor.reshape(batch * heads, *rest).reshape(heads, batch, *rest).transpose(0, 1)


def _flattened_apart(original):
    def gqa_operands(query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        key, value, gqa = original(query, key, value)
        return _head_major(key), _head_major(value), gqa

    return gqa_operands


def _widened_by_two(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Each key/value head twice (the group the kernel was written for), then tiled up to ``heads``."""
    wide = tensor.repeat_interleave(2, dim=1)
    return wide.repeat(1, heads // wide.shape[1], 1, 1)


def _group_of_two(original):
    def launch_sdpa(query, key, value, *, attn_mask=None, is_causal=False, scale, enable_gqa):
        if enable_gqa:
            key, value = _widened_by_two(key, query.shape[1]), _widened_by_two(value, query.shape[1])
        return original(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=False)

    return launch_sdpa


def _generated_image_only(original):
    def image_spans(layout: AttentionLayout) -> tuple[tuple[int, int], ...]:
        return original(layout)[-1:]

    return image_spans


def _special_rows_see_image(q_pos: torch.Tensor, kv_pos: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return masks.causal_mask(q_pos, kv_pos) | ((kv_pos >= start) & (kv_pos < end))


ablation(
    "attention.span_end_off_by_one", "harness.attention.masks:span_bounds", _span_end_early, wraps=True,
    kills=["attention.gpu.prefill.flex", "attention.gpu.prefill.flex.block64",
           "attention.contract.prefill.mismatches", "attention.contract.prefill.density",
           "attention.contract.prefill.span", "attention.contract.denoise.density",
           "attention.contract.denoise.histogram", "attention.capture.prefill.contract",
           "attention.denoise.decomposed.vs_sdpa", "attention.prefill.flex.vs_sdpa", "attention.images.flex.vs_sdpa"],
    why="the image block ends one token early: the span rows lose the last image key",
    kill_mode="fact",
    modes={"attention.denoise.decomposed.vs_sdpa": "tolerance", "attention.prefill.flex.vs_sdpa": "tolerance",
           "attention.images.flex.vs_sdpa": "tolerance",
           "attention.gpu.prefill.flex": "tolerance",
           "attention.gpu.prefill.flex.block64": "tolerance"},
    fact={
        "attention.contract.prefill.mismatches": "mask == formula with span",
        "attention.contract.prefill.density": "density rounds to the seed's",
        "attention.contract.prefill.span": "span detection recovers prefill",
        "attention.contract.denoise.density": "density rounds to the seed's",
        "attention.contract.denoise.histogram": "row-visibility histogram == {",
        "attention.capture.prefill.contract": "build_mask(prefill",
    },
)
ablation(
    "attention.span_start_off_by_one", "harness.attention.masks:span_bounds", _span_start_late, wraps=True,
    kills=["attention.contract.prefill.mismatches", "attention.contract.prefill.span",
           "attention.contract.denoise.mismatches", "attention.contract.denoise.span",
           "attention.capture.denoise.contract", "attention.prefill.decomposed.vs_sdpa",
           "attention.gqa.flex.vs_sdpa", "attention.bf16.flex.vs_sdpa"],
    why="the image block starts one token late: the first image row is treated as a causal text row",
    kill_mode="fact",
    modes={"attention.prefill.decomposed.vs_sdpa": "tolerance", "attention.gqa.flex.vs_sdpa": "tolerance",
           "attention.bf16.flex.vs_sdpa": "tolerance"},
    fact={
        "attention.contract.prefill.mismatches": "mask == formula with span",
        "attention.contract.prefill.span": "span detection recovers prefill",
        "attention.contract.denoise.mismatches": "mask == formula with span",
        "attention.contract.denoise.span": "span detection recovers denoise",
        "attention.capture.denoise.contract": "build_mask(denoise",
    },
)
ablation(
    "attention.is_causal_only", "harness.attention.masks:build_mask", _causal_only_mask,
    kills=["attention.contract.prefill.mismatches", "attention.contract.prefill.density",
           "attention.contract.denoise.histogram", "attention.capture.prefill.contract",
           "attention.prefill.block_padded.vs_sdpa", "attention.mask_free.detected",
           "attention.bf16.block_padded.vs_sdpa"],
    why="the structured mask is dropped for is_causal: the image rows lose the bidirectional span block",
    kill_mode="fact",
    modes={"attention.prefill.block_padded.vs_sdpa": "tolerance", "attention.mask_free.detected": "tolerance",
           "attention.bf16.block_padded.vs_sdpa": "tolerance"},
    fact={
        "attention.contract.prefill.mismatches": "mask == formula with span",
        "attention.contract.prefill.density": "density rounds to the seed's",
        "attention.contract.denoise.histogram": "row-visibility histogram == {",
        "attention.capture.prefill.contract": "build_mask(prefill",
    },
)
ablation(
    "attention.pad_keys_unmasked", "harness.attention.padded:pad_mask", _pad_keys_visible, wraps=True,
    kills=["attention.gpu.prefill.block_padded", "attention.gpu.denoise.block_padded",
           "attention.gpu.prefill.block_padded.block64", "attention.gpu.denoise.block_padded.block64",
           "attention.prefill.block_padded.vs_sdpa", "attention.denoise.block_padded.vs_sdpa",
           "attention.denoise.block_padded.block64.vs_sdpa", "attention.gqa.block_padded.vs_sdpa",
           "attention.images.block_padded.vs_sdpa", *ids_where(block="unaligned")],
    why="the zero pad keys stay visible to real rows: each row's softmax leaks weight onto padding (there are pad "
        "keys only where KV is not a multiple of the block)",
    kill_mode="tolerance",
)
ablation(
    "attention.split_wrong_row", "harness.attention.decomposed:split_rows", _split_one_row_late, wraps=True,
    kills=["attention.gpu.prefill.decomposed", "attention.gpu.denoise.decomposed",
           "attention.prefill.decomposed.vs_sdpa", "attention.denoise.decomposed.vs_sdpa",
           "attention.gqa.decomposed.vs_sdpa", "attention.images.decomposed.vs_sdpa",
           "attention.aligned.decomposed.vs_sdpa", "attention.bf16.decomposed.vs_sdpa"],
    why="the decomposition splits one row late: the first span row runs causally and misses the image keys",
    kill_mode="tolerance",
)
ablation(
    "attention.special_rows_image_visibility", "harness.attention.masks:special_row_visibility",
    _special_rows_see_image,
    kills=["attention.gpu.denoise.flex", "attention.gpu.denoise.flex.block64", "attention.contract.denoise.mismatches",
           "attention.contract.denoise.density", "attention.contract.denoise.histogram",
           "attention.contract.denoise.span", "attention.capture.denoise.contract", "attention.denoise.flex.vs_sdpa",
           "attention.denoise.block_padded.vs_sdpa", "attention.denoise.block_padded.block64.vs_sdpa",
           "attention.aligned.flex.vs_sdpa", "attention.aligned.block_padded.vs_sdpa"],
    why="the special rows are given the image rows' visibility: at denoise they see the whole span",
    kill_mode="fact",
    modes={"attention.denoise.flex.vs_sdpa": "tolerance", "attention.denoise.block_padded.vs_sdpa": "tolerance",
           "attention.aligned.flex.vs_sdpa": "tolerance", "attention.aligned.block_padded.vs_sdpa": "tolerance",
           "attention.denoise.block_padded.block64.vs_sdpa": "tolerance", "attention.gpu.denoise.flex": "tolerance",
           "attention.gpu.denoise.flex.block64": "tolerance"},
    fact={
        "attention.contract.denoise.mismatches": "mask == formula with span",
        "attention.contract.denoise.density": "density rounds to the seed's",
        "attention.contract.denoise.histogram": "row-visibility histogram == {",
        "attention.contract.denoise.span": "span detection recovers denoise",
        "attention.capture.denoise.contract": "build_mask(denoise",
    },
)
ablation(
    "attention.gqa_kv_expanded", "harness.attention.primitives:gqa_operands", _kv_expanded_before_launch,
    kills=["attention.gqa.decomposed.vs_sdpa", "attention.gqa.block_padded.vs_sdpa"],
    why="key/value heads are expanded over the GQA groups (repeat_interleave) before the launch: the same numbers "
        "at H / Hkv times the memory traffic, the copy a GQA-capable kernel exists to avoid",
    kill_mode="fact",
    fact="compressed key/value heads",
)
ablation(
    "attention.block_size_ignored", "harness.attention.padded:padded_length", _seed_block_always, wraps=True,
    kills=["attention.denoise.block_padded.block64.vs_sdpa"],
    why="the padded kernel pads to the seed's 128 whatever block it is asked for: exact numbers, wrong tiling",
    kill_mode="fact",
    fact="the launch runs block-aligned (64) lengths",
)
ablation(
    "attention.earlier_images_dropped", "harness.attention.masks:image_spans", _generated_image_only, wraps=True,
    kills=["attention.images.decomposed.vs_sdpa", "attention.images.flex.vs_sdpa",
           "attention.images.block_padded.vs_sdpa", "attention.bf16.decomposed.vs_sdpa",
           "attention.bf16.flex.vs_sdpa", "attention.bf16.block_padded.vs_sdpa", *ids_where()],
    why="only the generated image's span is bidirectional: the rows of the prompt's earlier images stay causal and "
        "miss the later keys of their own image",
    kill_mode="tolerance",
)


# name -> (seam, the bug, whether it wraps the seam's function, the axis and value of the only class it shows in, why)
INPUT_SPACE_BUGS = {
    "attention.scale_dropped": (
        "harness.attention.reference:resolve_scale", _default_scale_always, False, ("scale", "custom"),
        "the kernel computes at 1 / sqrt(D) whatever scale it is passed: right whenever the scale is the default"),
    "attention.batch_head_flattened_apart": (
        "harness.attention.primitives:gqa_operands", _flattened_apart, True, ("batch", "b2"),
        "the query's batch and head axes are flattened head-major (H, B) and key/value's batch-major (B, Hkv), so "
        "query row (b, h) reads key/value slot (h // group) * B + b of the batch-major order: right whenever B = 1"),
    "attention.gqa_group_hard_coded": (
        "harness.attention.primitives:launch_sdpa", _group_of_two, True, ("group", "g4"),
        "the launch widens key/value by the group 2 it was written for and tiles the rest, so query head h reads "
        "key/value head (h // 2) mod Hkv: right for groups 1 and 2, wrong for 4"),
}
for _name, (_seam, _bug, _wraps, (_axis, _value), _why) in INPUT_SPACE_BUGS.items():
    ablation(_name, _seam, _bug, wraps=_wraps, kills=ids_where(**{_axis: _value}), why=_why, kill_mode="tolerance")


# ------------------------------------------------------------------------------ installed kernels


INSTALLED = [name for name in kernels.kernels_under_test() if name not in kernels.KERNELS]


def _key_value_swapped(original):
    def kernel_under_test(spec, block):
        fn, impl = original(spec, block)
        return (lambda query, key, value, layout, *, scale=None: fn(query, value, key, layout, scale=scale)), impl
    return kernel_under_test


if INSTALLED:  # claims every check of a kernel an installed package registers (none otherwise)
    ablation(
        "attention.key_value_swapped", "harness.attention.judge:_kernel_under_test", _key_value_swapped, wraps=True,
        kills=[str(c) for c in CheckId.grid("attention", ("prefill", "denoise", "gqa", *INPUT_CASES), INSTALLED,
                                             ("vs_sdpa",))],
        why="the harness hands the kernel under test its value where the key belongs: any kernel that honours its "
            "arguments gives another output",
        kill_mode="tolerance",
    )
