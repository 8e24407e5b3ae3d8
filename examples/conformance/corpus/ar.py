"""Reported batched-generation bugs re-created in ``fast_rollout(backend, batch, max_new_tokens, eos)``
(``--impl ar=corpus.ar:NAME``).

Each callable is ``zoo_ar``'s right rollout with the one flaw its report describes (``REPORTS``). A report about
left-padded batches is re-created in its original form where its entry's flaws say ``left``: the zoo's left-padded
rollout, which declares ``padding_side = "left"`` and is judged by the left-padded checks. The entries without it
re-create their mistake in the right-padded layout (each row's pads after its prompt).
"""

from __future__ import annotations

from dataclasses import replace

import zoo_ar
from zoo_ar import CORRECT, LEFT

from corpus import Report

__all__ = ["REPORTS", "mistral_inference_finished_rows_keep_sampling", "mlx_lm_minicpm3_left_padding_mask_ignored",
           "mlx_vlm_batch_padding_lost", "opennmt_py_left_padding_mask_first_step_only",
           "transformers_gpt2_next_token_from_pad_column", "transformers_static_cache_decode_sees_pads",
           "unsloth_positions_from_shared_cache_position"]

REPORTS = {
    "unsloth_positions_from_shared_cache_position": Report(
        url="https://github.com/unslothai/unsloth/issues/3699",
        project="unsloth",
        version="main as of 2025-12 (FastLanguageModel inference path; fixed by PR #4100)",
        mechanism=(
            "Unsloth's prepare-inputs hook for generation set position_ids to cache_position, one counter shared "
            "by the whole batch. With left-padded rows of different lengths each row needs its own positions "
            "(its count of real tokens so far); the shared counter gave every padded row positions shifted by its "
            "padding, so RoPE rotated its queries and keys by the wrong angles and the shorter prompts produced "
            "garbage while the longest, unpadded one stayed right."),
        recreation=("Decode steps take every row's RoPE position from the shared cache slot (width + step, what a "
                    "batch-wide cache_position holds) instead of the row's own real_pos + step. Through the "
                    "transformers backend, whose decode positions this controls; the upstream layout ties "
                    "positions to per-row write slots, so there it has no effect."),
        checks=("ar.qwen3.unequal_real_pos.tokens", "ar.qwen3.length_skew.logp", "ar.hunyuan_moe.concat.logp",
                "ar.qwen3.padded_b1.equals_unpadded"),
        flaws=replace(CORRECT, shared_positions=True)),
    "mistral_inference_finished_rows_keep_sampling": Report(
        url="https://github.com/mistralai/mistral-inference/pull/270",
        project="mistral-inference",
        version="main as of 2026-03 (generate with eos_id)",
        mechanism=(
            "The batched generate loop only stopped once every row had produced EOS. Until then a row that had "
            "already finished kept sampling, its new tokens and their log-probabilities were appended to its "
            "output, and those tokens were fed back to the model, so early-finishing rows came back with junk after "
            "their EOS and log-probs that no longer matched the text."),
        recreation=("Rows keep sampling, recording log-probs and writing KV after their EOS. Identical to the zoo's "
                    "finished_rows_keep_sampling, so the two share one conformance run."),
        checks=("ar.fake.finished_rows", "ar.qwen3.first_token_eos.finished_rows", "ar.fake.b1.tokens"),
        flaws=replace(CORRECT, ignore_eos=True)),
    "transformers_gpt2_next_token_from_pad_column": Report(
        url="https://github.com/huggingface/transformers/issues/3167",
        project="transformers",
        version="not stated in the report (GPT2LMHeadModel, filed 2020-03-07)",
        mechanism=(
            "A right-padded batch was run through GPT-2 with an attention mask and the next token of every row was "
            "read from the logits of the last column. For a shorter row that column is a pad, whose logits say "
            "nothing about the prompt, so its next token differed from the unbatched run even though the mask hid "
            "the pads; the row has to be read at its own last real token."),
        recreation=("The first token is read from the prefill logits at the last column of the padded buffer, not "
                    "at each row's real_pos - 1. Identical to the zoo's first_logits_at_the_padded_tail, so the two "
                    "share one conformance run."),
        checks=("ar.qwen3.unequal_real_pos.tokens", "ar.fake.unequal_real_pos.tokens",
                "ar.fake.padded_b1.equals_unpadded"),
        flaws=replace(CORRECT, tail_logits=True)),
    "transformers_static_cache_decode_sees_pads": Report(
        url="https://github.com/huggingface/transformers/issues/30670",
        project="transformers",
        version="4.41.0.dev0 (the static kv-cache example of the LLM inference guide)",
        mechanism=(
            "The documented static-cache decoding loop called the model one token at a time with the cache position "
            "but without the batch's attention mask. The model then masked only by cache position, which hides "
            "the slots not yet written but not the padding written at prefill, so every padded row attended to its "
            "pad keys and the same prompt generated differently depending on what it was batched with."),
        recreation=("Decode masks admit every prompt column written at prefill, pads included (and the prefill "
                    "mask is plain causal), while unwritten cache slots stay masked."),
        checks=("ar.qwen3.unequal_real_pos.tokens", "ar.fake.nan_unused_slots", "ar.hunyuan_moe.length_skew.logp"),
        flaws=replace(CORRECT, pads_visible=True)),
    "mlx_vlm_batch_padding_lost": Report(
        url="https://github.com/Blaizzy/mlx-vlm/pull/1543",
        project="mlx-vlm",
        version="main as of 2026-07 (batch_generate, text-only prompts)",
        mechanism=(
            "batch_generate padded text-only prompts to one length in the tokenizer and passed the equal-length "
            "rows on; the batch generator derived each row's padding from the row lengths, found none, and built "
            "no key-padding mask. The tokenizer's own attention mask was dropped, so the more-padded rows attended "
            "to their pads and decoded wrongly or came back empty."),
        recreation=("The padding is lost: every prompt column is a key for every decode step, pads included (the "
                    "prefill mask plain causal). The same flaw as the transformers static-cache report, so the two "
                    "share one conformance run."),
        checks=("ar.qwen3.unequal_real_pos.tokens", "ar.fake.nan_unused_slots", "ar.fake.all_padded.tokens"),
        flaws=replace(CORRECT, pads_visible=True)),
    "opennmt_py_left_padding_mask_first_step_only": Report(
        url="https://github.com/OpenNMT/OpenNMT-py/pull/2532",
        project="OpenNMT-py",
        version="master as of 2023-12 (LM inference with the left padding added by PR #2525)",
        mechanism=(
            "OpenNMT-py had just added left padding for decoder-only LM inference: prompts of different lengths "
            "were left-padded into one batch and decoded over a KV cache. The decoder applied the padding mask at "
            "the first decoding step only, when the whole prompt runs; at every later step, one new token per row, "
            "it attended without a mask, so each padded row's new token also attended the pad positions its cache "
            "held from the prompt. Outputs degraded whenever a batch held prompts of different lengths; the fix "
            "applies the padding mask at all decoding steps."),
        recreation=("Left-padded, as reported: the prefill masks the pads and every decode step runs without a mask. "
                    "Identical to the zoo's left_decode_mask_dropped, so the two share one conformance run."),
        checks=("ar.qwen3.left.unequal_real_pos.logp", "ar.fake.left.length_skew.tokens",
                "ar.hunyuan_moe.left.nan_unused_slots"),
        flaws=replace(LEFT, no_decode_mask=True)),
    "mlx_lm_minicpm3_left_padding_mask_ignored": Report(
        url="https://github.com/ml-explore/mlx-lm/issues/1906",
        project="mlx-lm",
        version="main as of 2026-09 (BatchGenerator over BatchKVCache, the MiniCPM3 model file)",
        mechanism=(
            "MiniCPM3's model built its attention mask from the whole list of per-layer caches instead of one "
            "cache. The mask helper reaches the padding-aware mask only through a cache's make_mask, which a list "
            "lacks, so the prompt pass got a plain causal mask and every one-token decode step no mask at all: the "
            "batch cache's left padding was never read. In batch generation the shorter, left-padded prompts "
            "attended their pad tokens at the prefill and at every decode step and decoded differently from the "
            "same prompts alone, while their positions were right."),
        recreation=("Left-padded, as reported, with positions from the mask: the pads are ordinary keys, the prefill "
                    "mask plain causal and every decode mask admitting the pads' slots. Identical to the zoo's "
                    "left_pad_keys_visible, so the two share one conformance run."),
        checks=("ar.qwen3.left.unequal_real_pos.tokens", "ar.fake.left.nan_unused_slots",
                "ar.hunyuan_moe.left.all_padded.logp"),
        flaws=replace(LEFT, pads_visible=True)),
}


_MADE = {name: report.recreate(zoo_ar._implementation) for name, report in REPORTS.items()}
unsloth_positions_from_shared_cache_position = _MADE["unsloth_positions_from_shared_cache_position"]
mistral_inference_finished_rows_keep_sampling = _MADE["mistral_inference_finished_rows_keep_sampling"]
transformers_gpt2_next_token_from_pad_column = _MADE["transformers_gpt2_next_token_from_pad_column"]
transformers_static_cache_decode_sees_pads = _MADE["transformers_static_cache_decode_sees_pads"]
mlx_vlm_batch_padding_lost = _MADE["mlx_vlm_batch_padding_lost"]
opennmt_py_left_padding_mask_first_step_only = _MADE["opennmt_py_left_padding_mask_first_step_only"]
mlx_lm_minicpm3_left_padding_mask_ignored = _MADE["mlx_lm_minicpm3_left_padding_mask_ignored"]
