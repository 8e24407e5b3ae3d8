"""Reported attention-kernel bugs re-created in ``kernel(query, key, value, layout, *, scale=None)``
(``--impl attention=corpus.attention:NAME``).

Each callable is ``zoo_attention``'s right kernel with the one flaw its report describes (``REPORTS``).
"""

from __future__ import annotations

from dataclasses import replace

import zoo_attention
from zoo_attention import CORRECT

from corpus import Report

__all__ = ["REPORTS", "axlearn_gqa_heads_tiled", "onnx_attention_gqa_heads_tiled",
           "pytorch_flex_paged_kv_tail_unmasked", "skainet_default_scale_applied_as_zero",
           "transformers_gemma3_bidirectional_mask_dropped", "transformers_gemma3_images_see_later_images"]

REPORTS = {
    "onnx_attention_gqa_heads_tiled": Report(
        url="https://github.com/onnx/onnx/pull/7274",
        project="onnx",
        version="Attention operator, opset 23 function body (before PR #7274, 2025-09)",
        mechanism=(
            "With fewer key/value heads than query heads, the operator's function body widened the key/value "
            "tensors with Tile along the head axis, so the expanded heads came out as kv0, kv1, kv0, kv1. PyTorch "
            "and every GQA checkpoint expect each key/value head repeated in place (kv0, kv0, kv1, kv1), so query "
            "head h reads key/value head h % Hkv instead of h // (H / Hkv): every query head but the first of each "
            "group attends with another group's keys and values, with no error and the right output shape."),
        recreation=("Key/value heads widened with repeat (a tile over the head axis) instead of repeat_interleave. "
                    "Identical to the zoo's gqa_tiled, so the two share one conformance run."),
        checks=("attention.gqa.decomposed.vs_sdpa", "attention.images.decomposed.vs_sdpa",
                "attention.aligned.decomposed.vs_sdpa", "attention.bf16.decomposed.vs_sdpa"),
        flaws=replace(CORRECT, tiled_gqa=True)),
    "axlearn_gqa_heads_tiled": Report(
        url="https://github.com/apple/axlearn/pull/842",
        project="axlearn",
        version="main after PR #837 (2024-11), before PR #842",
        mechanism=(
            "A refactor of the grouped-query attention path changed how key/value heads are broadcast to the "
            "query heads: the new code produced the tiled order (every key/value head once, then again) where the "
            "original jnp.repeat gave each key/value head its consecutive block of query heads. The follow-up PR "
            "restored the repeat order, since checkpoints trained with it pair query head h with key/value head "
            "h // group."),
        recreation=("Key/value heads widened with repeat (a tile over the head axis) instead of repeat_interleave. "
                    "The same mechanism as the onnx report and the zoo's gqa_tiled."),
        checks=("attention.gqa.decomposed.vs_sdpa", "attention.images.decomposed.vs_sdpa",
                "attention.aligned.decomposed.vs_sdpa", "attention.bf16.decomposed.vs_sdpa"),
        flaws=replace(CORRECT, tiled_gqa=True)),
    "transformers_gemma3_images_see_later_images": Report(
        url="https://github.com/huggingface/transformers/issues/38053",
        project="transformers",
        version="4.51.3 (Gemma3; fixed by PR #38080)",
        mechanism=(
            "Gemma 3 lets the tokens of one image attend to each other in both directions, while attention across "
            "images stays causal. The mask builder marked every image token of the prompt as one bidirectional "
            "block, so with several images the tokens of an earlier image also attended to the tokens of every "
            "later image, seeing content that comes after them in the sequence."),
        recreation=("Every image token may attend to every image token of the prompt: the union of the image spans "
                    "is one bidirectional block, instead of one block per image."),
        checks=("attention.images.decomposed.vs_sdpa", "attention.bf16.decomposed.vs_sdpa"),
        flaws=replace(CORRECT, images_one_block=True)),
    "transformers_gemma3_bidirectional_mask_dropped": Report(
        url="https://github.com/huggingface/transformers/issues/39389",
        project="transformers",
        version="4.53.2 (Gemma3)",
        mechanism=(
            "After the mask refactor, the bidirectional mask Gemma 3 builds for image tokens no longer reached the "
            "attention forward at prefill: the mask that arrived was purely causal, so image tokens attended only "
            "to earlier image tokens, as text does, and the image was read the way the model was never trained."),
        recreation=("A plain causal mask: no image span is bidirectional. Identical to the zoo's causal_only, so the "
                    "two share one conformance run."),
        checks=("attention.prefill.decomposed.vs_sdpa", "attention.denoise.decomposed.vs_sdpa",
                "attention.gqa.decomposed.vs_sdpa", "attention.images.decomposed.vs_sdpa",
                "attention.aligned.decomposed.vs_sdpa", "attention.bf16.decomposed.vs_sdpa"),
        flaws=replace(CORRECT, causal_only=True)),
    "pytorch_flex_paged_kv_tail_unmasked": Report(
        url="https://github.com/pytorch/pytorch/issues/159247",
        project="pytorch",
        version="FlexAttention paged attention, main as of 2025-07 (fixed by PR #160861)",
        mechanism=(
            "Paged FlexAttention works in whole KV blocks of 128. When the KV length was not a multiple of the block, "
            "converting the logical block mask to the physical one applied no upper bound on the key index, so the "
            "slots past the real KV length in the last block stayed unmasked and took part in the softmax: the "
            "output drifted from standard attention by the weight those padding slots received."),
        recreation=("Keys and values padded with zeros up to the next multiple of 128 when KV is not aligned, the "
                    "padding slots left visible to every query row."),
        checks=("attention.prefill.decomposed.vs_sdpa", "attention.denoise.decomposed.vs_sdpa",
                "attention.gqa.decomposed.vs_sdpa", "attention.images.decomposed.vs_sdpa"),
        flaws=replace(CORRECT, pad_tail_unmasked=True)),
    "skainet_default_scale_applied_as_zero": Report(
        url="https://github.com/SKaiNET-developers/SKaiNET/issues/860",
        project="SKaiNET",
        version="0.36.0 (CPU backend; fixed by PR #880)",
        mechanism=(
            "scaledDotProductAttention documented its scale as defaulting to 1/sqrt(head dim) and encoded that "
            "default as the value 0. The CPU backend multiplied the scores by the literal 0, so every score "
            "became equal and the softmax averaged the visible values uniformly; masks and shapes still looked right."),
        recreation=("scale=None (the signature's \"use the default\") applied as a scale of 0, giving uniform "
                    "weights over each row's visible keys."),
        checks=("attention.images.decomposed.vs_sdpa", "attention.aligned.decomposed.vs_sdpa"),
        flaws=replace(CORRECT, scale_none_zero=True)),
}


_MADE = {name: report.recreate(zoo_attention._kernel) for name, report in REPORTS.items()}
onnx_attention_gqa_heads_tiled = _MADE["onnx_attention_gqa_heads_tiled"]
axlearn_gqa_heads_tiled = _MADE["axlearn_gqa_heads_tiled"]
transformers_gemma3_images_see_later_images = _MADE["transformers_gemma3_images_see_later_images"]
transformers_gemma3_bidirectional_mask_dropped = _MADE["transformers_gemma3_bidirectional_mask_dropped"]
pytorch_flex_paged_kv_tail_unmasked = _MADE["pytorch_flex_paged_kv_tail_unmasked"]
skainet_default_scale_applied_as_zero = _MADE["skainet_default_scale_applied_as_zero"]
