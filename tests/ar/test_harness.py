"""The ar harness itself: batch construction, seams, guards and error messages, backends, spies."""

from __future__ import annotations

import pytest
import torch

from fakes.ar_hunyuan_common import eager_attention
from fixtures import ar_models
from fixtures.ar_cases import prompt_ids
from harness.ar import loop, masks
from harness.ar.batch import concat, embed_row, pad_positions, right_padded_batch
from harness.ar.replay import teacher_forced_logp
from harness.ar.spy import ARForwardSpy
from harness.judging.compare import max_abs_diff

pytestmark = pytest.mark.cpu

PAD = ar_models.PAD_ID


# --------------------------------------------------------------------------------------------- batches


def test_concat_pads_positions_with_each_rows_continuing_indices() -> None:
    prompts = prompt_ids([3, 6, 1], seed=1)
    batch = concat([embed_row(p) for p in prompts], PAD)
    assert batch.position_ids.tolist() == [list(range(6))] * 3
    assert batch.real_pos.tolist() == [[3], [6], [1]]
    assert batch.input_ids[0, 3:].tolist() == [PAD] * 3
    assert not batch.attention_mask[0, 0, 3:].any() and not batch.attention_mask[0, 0, :, 3:].any()
    assert torch.equal(batch.attention_mask[1, 0], torch.ones(6, 6, dtype=torch.bool).tril())
    assert pad_positions(torch.tensor([[4, 5, 6]]), 5).tolist() == [[4, 5, 6, 7, 8]]


def test_right_padded_batch_layout() -> None:
    batch = right_padded_batch(prompt_ids([2, 5], seed=2), PAD, width=7)
    assert batch.real_pos.tolist() == [[2], [5]] and batch.width == 7
    assert batch.position_ids.tolist() == [list(range(7))] * 2
    assert [p.numel() for p in batch.prompts()] == [2, 5]


@pytest.mark.parametrize(("call", "match"), [
    (lambda: right_padded_batch([], PAD), "at least one prompt"),
    (lambda: right_padded_batch([[]], PAD), "prompt 0 is empty"),
    (lambda: right_padded_batch([[1, 2, 3]], PAD, width=2), "shorter than the longest"),
    (lambda: right_padded_batch([[[1, 2]]], PAD), "1-D sequence"),
    (lambda: concat([], PAD), "at least one embedded row"),
    (lambda: pad_positions(torch.tensor([[0, 1, 2]]), 2), "cannot pad"),
])
def test_bad_batch_inputs_raise_clear_errors(call, match) -> None:
    with pytest.raises(ValueError, match=match):
        call()


# --------------------------------------------------------------------------------------------- guards


@pytest.mark.parametrize("lengths", [(9,), (9, 4, 7, 5)])
def test_missing_real_pos_raises_naming_it(lengths) -> None:
    batch = right_padded_batch(prompt_ids(lengths, seed=3), PAD).without_real_pos()
    with pytest.raises(ValueError, match=r"tokenizer_output\.real_pos \[B, 1\].*every batch size"):
        loop.init_state(ar_models.backend("fake"), batch, 3)


def test_real_pos_out_of_range_and_bad_steps_raise() -> None:
    backend = ar_models.backend("fake")
    batch = right_padded_batch(prompt_ids((4, 6), seed=4), PAD)
    bad = type(batch)(batch.input_ids, batch.position_ids, batch.attention_mask, torch.tensor([[0], [6]]), PAD)
    with pytest.raises(ValueError, match=r"real_pos must lie in \[1, 6\] .*, got \[0, 6\]$"):  # plain numbers
        loop.init_state(backend, bad, 2)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        loop.init_state(backend, batch, 0)
    state = loop.init_state(backend, batch, 1)
    loop.step(state)
    with pytest.raises(ValueError, match="rollout is done"):
        loop.step(state)
    with pytest.raises(TypeError, match="bool"):
        masks.prefill_mask(batch.attention_mask.float(), 8)


def test_finished_row_on_a_dynamic_cache_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.ar import cache as ar_cache

    backend = ar_models.backend("qwen3")
    batch = right_padded_batch(prompt_ids((5, 8), seed=5), PAD)
    reference = loop.stock_rollout(backend, batch.prompts(), 3)
    monkeypatch.setattr(ar_cache, "cache_is_dynamic", lambda batch_size: True)
    state = loop.init_state(backend, batch, 3, eos=(int(reference.tokens[0, 0]),))
    loop.step(state)
    with pytest.raises(ValueError, match="dynamic cache cannot leave a row's slot unwritten"):
        loop.step(state)


# --------------------------------------------------------------------------------------------- seams


def test_place_token_writes_each_rows_column_in_place() -> None:
    ids = torch.tensor([[5, 0, 0, 0], [6, 7, 8, 0]])
    out = loop.place_token(ids, torch.tensor([11, 12]), torch.tensor([1, 3]))
    assert out is ids and out.tolist() == [[5, 11, 0, 0], [6, 7, 8, 12]]
    assert loop.first_logits_column(torch.tensor([3, 8]), 8).tolist() == [2, 7]
    assert loop.should_write_kv(torch.tensor([True, False])).tolist() == [False, True]


def test_decode_masks_admit_exactly_the_valid_keys() -> None:
    backend = ar_models.backend("qwen3")
    batch = right_padded_batch(prompt_ids((3, 5), seed=6), PAD)
    state = loop.init_state(backend, batch, 3)
    state.step_idx = 2
    valid = backend.key_valid(state, torch.tensor([2, 1]), 8)
    assert valid.int().tolist() == [[1, 1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 1, 1, 1, 0, 0]]
    fake = ar_models.backend("fake")
    fake_state = loop.init_state(fake, batch, 3)
    assert fake.key_valid(fake_state, torch.tensor([2, 1]), 8).int().tolist() == [
        [1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]]


# --------------------------------------------------------------------------------------------- backends


@pytest.mark.parametrize("model", ["qwen3", "hunyuan_moe"])
def test_read_safe_kernel_matches_sdpa(model: str) -> None:
    """The NaN probe's kernel computes the same function as sdpa on finite inputs (same weights)."""
    prompt = prompt_ids([11], seed=8)[0]
    sdpa = ar_models.backend(model).full_forward(prompt)
    safe = ar_models.backend(model, "read_safe").full_forward(prompt)
    assert max_abs_diff(sdpa, safe) < 1e-5
    assert ar_models.transformers_model(model, "read_safe").config._attn_implementation == ar_models.READ_SAFE


@pytest.mark.parametrize("model", ar_models.BACKENDS)
def test_the_eager_kernel_computes_what_sdpa_does_on_the_same_weights(model: str) -> None:
    prompt = prompt_ids([9], seed=63)[0]
    assert max_abs_diff(ar_models.backend(model).full_forward(prompt),
                        ar_models.backend(model, "eager").full_forward(prompt)) < 1e-5


def test_the_fakes_eager_attention_is_a_minus_infinity_softmax() -> None:
    gen = torch.Generator().manual_seed(64)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=gen) for _ in range(3))
    mask = torch.tensor([[True, False, False], [True, True, False], [False, False, False]])[None, None]
    out = eager_attention(q, k, v, mask)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q[..., :2, :], k, v, attn_mask=mask[..., :2, :])
    torch.testing.assert_close(out[..., :2, :], sdpa)
    assert bool(out[..., 2, :].isnan().all())  # the row that admits no key
    bias = torch.zeros(1, 1, 3, 3).masked_fill(~mask, -1e9)
    torch.testing.assert_close(eager_attention(q, k, v, bias)[..., :2, :], sdpa)  # an additive mask is added
    torch.testing.assert_close(eager_attention(q, k, v, None, scale=0.5),
                               torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.5))
    with pytest.raises(ValueError, match="'sdpa', 'eager', 'read_safe'"):
        ar_models.backend("fake", "flash")


@pytest.mark.parametrize("model", ar_models.BACKENDS)
def test_stock_rollout_matches_teacher_forced_replay(model: str) -> None:
    backend = ar_models.backend(model)
    prompts = prompt_ids([6, 10], seed=9)
    stock = loop.stock_rollout(backend, prompts, 4)
    assert max_abs_diff(stock.logp, teacher_forced_logp(backend, prompts, stock)) < 5e-5


@pytest.mark.parametrize("model", ar_models.BACKENDS)
def test_spy_sees_batched_static_and_b1_dynamic(model: str) -> None:
    backend = ar_models.backend(model)
    prompts = prompt_ids([4, 9, 6], seed=10)
    with ARForwardSpy(backend.model) as spy:
        loop.fast_rollout(backend, right_padded_batch(prompts, PAD), 3)
    assert spy.batch_sizes == [3, 3, 3] and spy.static
    with ARForwardSpy(backend.model) as spy:
        loop.stock_rollout(backend, prompts[:1], 3)
    assert spy.batch_sizes == [1, 1, 1] and spy.dynamic


def test_hunyuan_moe_routing_is_drop_free() -> None:
    """transformers' HunYuanMoEV1 routes each token top-k with no expert capacity: crowding one expert pair with
    identical tokens changes nothing, so batch composition cannot change a row's routing."""
    moe = ar_models.transformers_model("hunyuan_moe").model.layers[0].mlp
    token = torch.randn(1, 1, moe.gate.wg.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        alone, crowd = moe(token), moe(token.expand(1, 64, -1).contiguous())
    assert max_abs_diff(crowd, alone.expand_as(crowd)) < 1e-5


def test_dense_fake_batched_equals_b1() -> None:
    from harness.ar import judge
    from harness.ar import policies as ar_policies

    backend = ar_models.backend("fake_dense")
    batch = right_padded_batch(prompt_ids((5, 13, 9), seed=11), PAD)
    fast = loop.fast_rollout(backend, batch, 4)
    reference = loop.stock_rollout(backend, batch.prompts(), 4)
    policies = ar_policies.fp32_policies(ar_policies.stock_prefill_floor(backend))
    for what in ("tokens", "logp", "prefill_kv", "slot0"):
        verdict = judge.compare_case(what, fast, reference, policies)
        assert verdict.passed, verdict.describe()


def test_shipped_backends_are_in_the_registry() -> None:
    from harness.ar import plugins as ar_plugins
    from harness.ar.backends import TransformersBackend, UpstreamBackend
    from harness.plugins import entry_points as plugins

    ar_plugins.register(plugins)
    ar_plugins.register(plugins)  # idempotent: the same objects
    assert plugins.AR_BACKENDS.get(ar_plugins.REMOTE_CODE) is UpstreamBackend
    assert plugins.AR_BACKENDS.get(ar_plugins.TRANSFORMERS) is TransformersBackend
