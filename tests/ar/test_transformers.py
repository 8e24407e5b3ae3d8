"""transformers' causal LMs under the harness: the backend's config reading, its hole layout, and its stock
loop pinned to transformers' own ``generate``."""

from __future__ import annotations

import types

import pytest
import torch

from fixtures import ar_models
from fixtures.ar_cases import eos_for_stops, prompt_ids
from harness.ar import loop, probes
from harness.ar.backends import TransformersBackend
from harness.ar.batch import right_padded_batch
from harness.judging.compare import max_abs_diff

pytestmark = pytest.mark.cpu

PAD = ar_models.PAD_ID


def test_transformers_backend_reads_pad_and_head_dim_from_the_config() -> None:
    """A config without ``pad_token_id`` pads with 0; one without ``head_dim`` derives it from the hidden size."""
    def forward(input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None):
        return input_ids

    bare = types.SimpleNamespace(pad_token_id=None, vocab_size=50, num_key_value_heads=2, hidden_size=48,
                                 num_attention_heads=4)
    backend = TransformersBackend(types.SimpleNamespace(config=bare, forward=forward), "bare")
    assert (backend.pad_id, backend.head_dim, backend.kv_heads, backend.vocab_size) == (0, 12, 2, 50)
    explicit = types.SimpleNamespace(**{**vars(bare), "pad_token_id": 7, "head_dim": 16})
    backend = TransformersBackend(types.SimpleNamespace(config=explicit, forward=forward), "explicit")
    assert (backend.pad_id, backend.head_dim) == (7, 16)


@pytest.mark.parametrize("model", ["qwen3", "hunyuan_moe"])
def test_a_full_forward_builds_no_cache(model: str) -> None:
    """``full_forward`` is one cache-free forward: the model is handed no cache and builds none (a cache the
    model made for it would hold the whole sequence's KV for nothing); it returns its logits alone."""
    backend = ar_models.backend(model)
    outputs = []
    handle = backend.model.register_forward_hook(lambda module, args, out: outputs.append(out))
    try:
        with torch.no_grad():
            logits = backend.full_forward(prompt_ids([6], seed=8)[0])
    finally:
        handle.remove()
    assert logits.shape == (6, ar_models.VOCAB) and [list(out.keys()) for out in outputs] == [["logits"]]


def test_transformers_hole_layout_slots() -> None:
    backend = ar_models.backend("qwen3")
    state = loop.init_state(backend, right_padded_batch(prompt_ids((3, 5), seed=45), PAD), 4)
    state.step_idx = 3
    assert backend.decode_write_slots(state).tolist() == [7, 7]  # shared slot width + step - 1
    assert backend.token_columns(state).tolist() == [8, 8]
    assert backend.logical_slots(3, 5, 2).tolist() == [0, 1, 2, 5, 6]  # prompt, then generated past the width
    assert backend.logical_slots(5, 5, 0).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("model", ["qwen3", "hunyuan_moe"])
def test_transformers_stock_loop_equals_generate(model: str) -> None:
    from transformers import GenerationConfig

    backend = ar_models.backend(model)
    prompt = prompt_ids([9], seed=7)[0]
    run = backend.stock_generate(prompt, 5, ())
    eos = int(run.tokens[2])
    stopped = backend.stock_generate(prompt, 5, (eos,))
    config = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    out = backend.model.generate(prompt[None], generation_config=config, output_logits=True,
                                 return_dict_in_generate=True)
    generated = out.sequences[0, prompt.numel():]
    assert torch.equal(generated, stopped.tokens)
    assert max_abs_diff(torch.stack(out.logits)[:, 0].float(), stopped.logits) < 1e-5


def test_finished_row_writes_are_rolled_back_in_the_shared_slot() -> None:
    """A row that stopped at EOS keeps decoding with the batch (every row writes the shared slot), but its
    writes are restored every step: its footprint after the prefill is its own generated tokens only."""
    backend = ar_models.backend("qwen3")
    prompts = prompt_ids((5, 8), seed=56)
    eos, ends = eos_for_stops(loop.stock_rollout(backend, prompts, 4).tokens, {0: 1})
    assert ends == [2, 4], "fixture: row 0 stops at step 1, row 1 runs on"
    run = probes.footprint_rollout(backend, right_padded_batch(prompts, PAD), 4, eos)
    assert run.rollout.lengths.tolist() == ends
    assert run.rollout.tokens[0, 2:].tolist() == [PAD, PAD] and run.rollout.logp[0, 2:].tolist() == [0.0, 0.0]
    assert run.static and run.stray_writes == {}
