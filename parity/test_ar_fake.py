"""The fake HunyuanImage-3 upstream keeps upstream's contract, and its stock loop shows seed 001's four defects.

Defects, each reproduced on the fake alone (no harness fast path involved):
1. stock generate at B > 1 with the cache upstream builds for gen_text (dynamic) -> AssertionError;
2. decode with no mask over a static cache reads stale pad KV and never-written slots -> wrong logits;
3. tail-appended tokens re-read by ``gather(1, position_ids)`` feed a short row its own pad;
4. zero-padded position_ids write every pad's KV onto slot 0 (last write wins).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fakes.ar_hunyuan import HunyuanImage3Config, HunyuanMoE, HunyuanStaticCache, build_rope_table
from fixtures import ar_models
from fixtures.ar_cases import prompt_ids
from harness.ar.batch import concat, embed_row, pad_seq, right_padded_batch
from harness.compare import max_abs_diff

pytestmark = pytest.mark.cpu

PAD = ar_models.PAD_ID


def _model():
    return ar_models.fake_upstream("moe")


def _cache(bsz: int, slots: int, dynamic: bool) -> HunyuanStaticCache:
    model = _model()
    return HunyuanStaticCache(config=model.config, max_batch_size=bsz, max_cache_len=slots, dtype=model.dtype,
                              dynamic=dynamic)


def _generate_kwargs(batch, cache) -> dict:
    return dict(attention_mask=batch.attention_mask, position_ids=batch.position_ids, past_key_values=cache,
                mode="gen_text", rope_image_info=None, tokenizer_output=SimpleNamespace(real_pos=batch.real_pos))


def _b1_generate(prompt: torch.Tensor, new_tokens: int):
    batch = right_padded_batch([prompt], PAD)
    cache = _cache(1, batch.width + new_tokens, dynamic=True)
    return _model().generate(batch.input_ids, max_new_tokens=new_tokens, **_generate_kwargs(batch, cache)), cache


# --------------------------------------------------------------------------------------------- defects


def test_stock_generate_asserts_at_batch_with_dynamic_cache() -> None:
    """Defect 1 (seed 002's crash): len(cache_position) of a 2-D cache_position is the batch dimension."""
    batch = right_padded_batch(prompt_ids([5, 9, 7], seed=1), PAD)
    cache = _cache(3, batch.width + 3, dynamic=True)  # what upstream's prepare_model_inputs builds for gen_text
    with pytest.raises(AssertionError):
        _model().generate(batch.input_ids, max_new_tokens=3, **_generate_kwargs(batch, cache))


def test_stock_generate_at_b1_runs_and_stops_at_eos() -> None:
    prompt = prompt_ids([8], seed=2)[0]
    out, _ = _b1_generate(prompt, 5)
    assert out.sequences.shape == (1, 13)
    eos = int(out.sequences[0, 10])  # the third generated token
    batch = right_padded_batch([prompt], PAD)
    stopped = _model().generate(batch.input_ids, max_new_tokens=5, eos_token_id=eos,
                                **_generate_kwargs(batch, _cache(1, 13, dynamic=True)))
    first = int((stopped.sequences[0, 8:] == eos).nonzero()[0])
    assert stopped.sequences.shape[1] == 8 + first + 1


def test_static_cache_stock_decode_without_mask_is_wrong() -> None:
    """Defect 2: the static cache returns every slot; upstream's unmasked decode attends all of them."""
    model = _model()
    prompts = prompt_ids([6, 12], seed=3)
    batch = right_padded_batch(prompts, PAD)
    slots = batch.width + 2
    cache = _cache(2, slots, dynamic=False)
    prefill_mask = pad_seq(batch.attention_mask, slots, 3, False)
    model(input_ids=batch.input_ids, attention_mask=prefill_mask, position_ids=batch.position_ids,
          past_key_values=cache)
    real_pos = batch.real_pos  # [2, 1]
    token = torch.tensor([[7], [9]])

    def decode(mask):
        snapshot = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        logits = model(input_ids=token, attention_mask=mask, position_ids=real_pos, past_key_values=cache).logits
        for layer, (k, v) in zip(cache.layers, snapshot, strict=True):
            layer.keys.copy_(k)
            layer.values.copy_(v)
        return logits[:, 0]

    per_row = (torch.arange(slots)[None] <= real_pos)[:, None, None, :]
    masked, unmasked = decode(per_row), decode(None)
    for row, prompt in enumerate(prompts):  # B=1 with upstream's trimmed dynamic cache needs no mask
        b1 = right_padded_batch([prompt], PAD)
        b1_cache = _cache(1, b1.width + 2, dynamic=True)
        model(input_ids=b1.input_ids, attention_mask=b1.attention_mask, position_ids=b1.position_ids,
              past_key_values=b1_cache)
        ref = model(input_ids=token[row: row + 1], position_ids=b1.real_pos, past_key_values=b1_cache).logits[0, 0]
        assert max_abs_diff(masked[row], ref) < 1e-4
        assert max_abs_diff(unmasked[row], ref) > 1e-2, f"row {row}: unmasked decode should read stale slots"


def test_tail_append_feeds_short_rows_their_pad() -> None:
    """Defect 3: after prefill, position_ids = real_pos; gather(1, real_pos) on tail-appended ids reads pads."""
    model = _model()
    batch = right_padded_batch(prompt_ids([4, 10, 7], seed=4), PAD)
    sampled = torch.tensor([31, 32, 33])
    appended = torch.cat([batch.input_ids, sampled[:, None]], dim=1)
    kwargs = model._update_model_kwargs_for_generation(SimpleNamespace(past_key_values=None), {
        "mode": "gen_text", "rope_image_info": None,
        "tokenizer_output": SimpleNamespace(real_pos=batch.real_pos)})
    fed = model.prepare_inputs_for_generation(appended, **kwargs)["input_ids"][:, 0]
    assert fed.tolist() == [PAD, 32, PAD]  # only the full-length row gets its sampled token


def test_zero_padded_position_ids_overwrite_slot0() -> None:
    """Defect 4: position_ids are the KV write index; zero pads all land on slot 0, last write wins."""
    model = _model()
    prompts = prompt_ids([5, 12], seed=5)
    rows = [embed_row(p) for p in prompts]
    width = 12
    position_ids = torch.cat([pad_seq(r.position_ids, width, 1, 0) for r in rows])
    good = concat(rows, PAD)

    def prefill_kv(position_ids: torch.Tensor) -> torch.Tensor:
        cache = _cache(2, width, dynamic=False)
        model(input_ids=good.input_ids, attention_mask=good.attention_mask, position_ids=position_ids,
              past_key_values=cache)
        return cache.layers[0].keys[0]  # the short row's layer-0 keys [H, slots, hd]

    ok, bad = prefill_kv(good.position_ids), prefill_kv(position_ids)
    alone = _cache(1, 5, dynamic=False)
    model(input_ids=rows[0].input_ids, attention_mask=rows[0].attention_mask, position_ids=rows[0].position_ids,
          past_key_values=alone)
    reference = alone.layers[0].keys[0]
    assert max_abs_diff(ok[:, :5], reference) < 1e-5
    assert max_abs_diff(bad[:, 0], reference[:, 0]) > 0.5  # slot 0 holds the last pad's KV
    assert max_abs_diff(bad[:, 1:5], reference[:, 1:5]) < 1e-5  # layer 0: every other real slot intact


# --------------------------------------------------------------------------------------------- contract


def test_cache_2d_writes_row_by_row_last_write_wins() -> None:
    cache = _cache(2, 6, dynamic=False)
    keys = torch.arange(2 * 2 * 3 * 4, dtype=torch.float32).reshape(2, 2, 3, 4)
    k, _ = cache.update(keys, keys + 1, 0, {"cache_position": torch.tensor([[0, 1, 2], [4, 4, 5]])})
    assert k.shape == (2, 2, 6, 4)  # static: every slot, unwritten zeros included
    assert torch.equal(k[0, :, :3], keys[0])
    assert torch.equal(k[1, :, 4], keys[1, :, 1])  # duplicate index 4: the later write wins
    assert torch.equal(k[1, :, 5], keys[1, :, 2])
    assert not k[0, :, 3:].any() and not k[1, :, :4].any()


def test_dynamic_cache_trims_at_b1_and_asserts_at_batch() -> None:
    cache = _cache(1, 8, dynamic=True)
    states = torch.ones(1, 2, 3, 4)
    k, _ = cache.update(states, states, 0, {"cache_position": torch.tensor([[2, 3, 4]])})
    assert k.shape == (1, 2, 5, 4)  # row 0's last position + 1
    batched = _cache(2, 8, dynamic=True)
    with pytest.raises(AssertionError):
        batched.update(torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4), 0, {"cache_position": torch.tensor([[3], [5]])})


def test_rope_tables_are_gathered_per_row_at_position_ids() -> None:
    model = _model()
    cos_table, sin_table = build_rope_table(model.config.max_position_embeddings, model.config.attention_head_dim,
                                            model.config.rope_theta)
    positions = torch.tensor([[0, 5, 9], [3, 3, 40]])
    cos, sin = model.rope(positions)
    assert cos.shape == (2, 3, model.config.attention_head_dim)
    assert torch.equal(cos[1], cos_table[0, positions[1]]) and torch.equal(sin[0], sin_table[0, positions[0]])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.rope(torch.tensor([[model.config.max_position_embeddings]]))


def test_pad_embedding_is_zero_and_gqa_shapes() -> None:
    model = _model()
    assert not model.wte.weight[PAD].any()
    attn = model.layers[0].self_attn
    assert attn.num_heads == 2 * attn.num_kv
    cache = _cache(1, 4, dynamic=False)
    model(input_ids=torch.tensor([[3, 4]]), attention_mask=torch.ones(1, 1, 2, 4, dtype=torch.bool).tril(),
          position_ids=torch.tensor([[0, 1]]), past_key_values=cache)
    assert cache.layers[0].keys.shape == (1, attn.num_kv, 4, attn.head_dim)


def test_moe_routes_every_token_without_capacity() -> None:
    """Drop-free top-k: a token's output does not depend on how many others chose the same experts."""
    config = HunyuanImage3Config(hidden_size=16, intermediate_size=8, num_experts=4, moe_topk=2)
    torch.manual_seed(0)
    moe = HunyuanMoE(config).eval()
    token = torch.randn(1, 1, 16)
    crowd = token.expand(1, 64, 16).contiguous()  # 64 identical tokens all pick the same two experts
    with torch.no_grad():
        alone, together = moe(token), moe(crowd)
    assert max_abs_diff(together, alone.expand_as(together)) < 1e-5
    assert together.abs().sum(-1).min() > 0


def test_update_model_kwargs_drops_mask_and_advances_positions() -> None:
    model = _model()
    out = SimpleNamespace(past_key_values="cache")
    first = model._update_model_kwargs_for_generation(out, {
        "mode": "gen_text", "rope_image_info": None, "attention_mask": torch.ones(1),
        "tokenizer_output": SimpleNamespace(real_pos=torch.tensor([[4], [9]]))})
    assert first["position_ids"].tolist() == [[4], [9]] and "attention_mask" not in first
    second = model._update_model_kwargs_for_generation(out, first)
    assert second["position_ids"].tolist() == [[5], [10]] and second["past_key_values"] == "cache"


def test_forward_refuses_other_modes() -> None:
    with pytest.raises(ValueError, match="gen_text"):
        _model()(input_ids=torch.tensor([[1, 2]]), mode="gen_image")
