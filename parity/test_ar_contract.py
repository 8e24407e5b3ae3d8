"""The fakes keep the real HunyuanImage-3 contract: one test per row of docs/ar-contract.md.

Each row was verified against the real upstream code (the numbers are in the doc); these tests hold the fakes to
it, for every generation the installed transformers can run (generation 1 is 4.x only, as the real hunyuan.py).
"""

from __future__ import annotations

import inspect
import sys
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import transformers

from fixtures import ar_models
from harness import compat
from harness.ar.backends import UpstreamBackend
from harness.ar.bf16 import kl_rows

pytestmark = pytest.mark.cpu

GEN1 = pytest.param(1, marks=pytest.mark.skipif(
    not compat.has_module("transformers.modeling_attn_mask_utils"),
    reason=f"generation 1 imports transformers.modeling_attn_mask_utils, removed in {transformers.__version__}"))
GENERATIONS = pytest.mark.parametrize("generation", [GEN1, 2], ids=["gen1", "gen2"])


def _model(generation: int, dtype: torch.dtype = torch.float32):
    model = ar_models.fake_upstream("moe", generation=generation)
    return model if dtype == torch.float32 else _cast(model, dtype)


def _cast(model, dtype):
    import copy

    return copy.deepcopy(model).to(dtype)


def _backend(generation: int, dtype: torch.dtype = torch.float32) -> UpstreamBackend:
    return UpstreamBackend(_model(generation, dtype))


def _kwargs(backend: UpstreamBackend, batch: int, length: int, real_pos: list[int], slots: int = 16) -> dict:
    return {"position_ids": torch.arange(length)[None].expand(batch, -1), "mode": "gen_text",
            "past_key_values": backend.new_cache(batch, slots, dynamic=batch == 1),
            "tokenizer_output": SimpleNamespace(real_pos=torch.tensor(real_pos)[:, None]),
            "attention_mask": torch.ones(length, length, dtype=torch.bool).tril()[None, None].expand(batch, -1, -1, -1),
            **backend.rope_kwargs(batch, slots, torch.device("cpu"))}


# ---------------------------------------------------------------------------------------------- RoPE plumbing
@GENERATIONS
def test_rope_plumbing(generation: int) -> None:
    backend = _backend(generation)
    model = backend.model
    params = inspect.signature(model.forward).parameters
    assert backend.generation == generation
    assert ("custom_pos_emb" in params) == (generation == 1) and ("rope_image_info" in params) == (generation == 2)
    ids, pos = torch.tensor([[5, 6], [7, 8]]), torch.arange(2)[None].expand(2, -1)
    if generation == 1:
        with pytest.raises(TypeError, match="cannot unpack"):  # upstream unpacks custom_pos_emb unconditionally
            model(input_ids=ids, position_ids=pos, mode="gen_text")
        module = sys.modules[type(model).__module__]
        with pytest.raises(AssertionError, match="len"):  # one table cannot serve two rows
            model(input_ids=ids, position_ids=pos, mode="gen_text",
                  custom_pos_emb=module.build_batch_2d_rope(16, 12, None, base=10000.0))
    else:
        with pytest.raises(RuntimeError):  # rope_image_info=None builds one table; gather needs one per row
            model(input_ids=ids, position_ids=pos, rope_image_info=None, mode="gen_text")
    out = model(input_ids=ids, position_ids=pos, mode="gen_text", **backend.rope_kwargs(2, 16, torch.device("cpu")))
    assert out.logits.shape == (2, 2, 96) and bool(torch.isfinite(out.logits).all())


# ---------------------------------------------------------------------------------- cache kwarg name per major
@GENERATIONS
def test_cache_kwarg_name_per_major(generation: int) -> None:
    backend = _backend(generation)
    model, name = backend.model, compat.cache_kwarg_name()
    kwargs = _kwargs(backend, 1, 3, [3])
    out = model(**model.prepare_inputs_for_generation(torch.tensor([[5, 6, 7]]), **kwargs))
    updated = model._update_model_kwargs_for_generation(out, kwargs)
    assert updated[name] is kwargs["past_key_values"]  # stored under ALL_CACHE_NAMES' first hit
    inputs = model.prepare_inputs_for_generation(torch.tensor([[5, 6, 7, 9]]), **updated)
    assert (inputs["past_key_values"] is None) == (name != "past_key_values")  # 5.x: the cache would be lost
    carried = compat.remote_code_kwargs(updated)
    assert model.prepare_inputs_for_generation(torch.tensor([[5, 6, 7, 9]]), **carried)["past_key_values"] is \
        kwargs["past_key_values"]


# ------------------------------------------------------------------------------------------- lazy-init arity
@GENERATIONS
def test_lazy_init_arity(generation: int) -> None:
    cache = _backend(generation).new_cache(1, 8, dynamic=False)
    original = type(cache.layers[0]).lazy_initialization
    calls = []

    def record(self, *tensors):
        calls.append(len(tensors))
        return original(self, *tensors)

    with mock.patch.object(type(cache.layers[0]), "lazy_initialization", record):
        cache.update(torch.zeros(1, 2, 3, 12), torch.zeros(1, 2, 3, 12), 0, {"cache_position": torch.arange(3)})
    assert calls == [1 if generation == 1 else compat.lazy_init_arity()]  # gen1: the key only, as hunyuan.py


# ------------------------------------------------------------------------------------------ returned cache shapes
@GENERATIONS
def test_returned_cache_shapes(generation: int) -> None:
    backend = _backend(generation)
    key = torch.randn(1, 2, 4, 12)
    static_k, _ = backend.new_cache(1, 10, dynamic=False).update(key, key, 0, {"cache_position": torch.arange(4)[None]})
    assert static_k.shape == (1, 2, 10, 12) and not static_k[:, :, 4:].any()  # full buffer, unwritten zeros
    dynamic_k, _ = backend.new_cache(1, 10, dynamic=True).update(key, key, 0, {"cache_position": torch.arange(4)[None]})
    assert dynamic_k.shape == (1, 2, 4, 12) and torch.equal(dynamic_k, key)  # trimmed to the last position + 1


# ---------------------------------------------------------------------------------- B>1 dynamic-cache assert
@GENERATIONS
def test_batched_dynamic_cache_asserts(generation: int) -> None:
    cache = _backend(generation).new_cache(2, 10, dynamic=True)
    key = torch.randn(2, 2, 4, 12)
    with pytest.raises(AssertionError):
        cache.update(key, key, 0, {"cache_position": torch.arange(4)[None].expand(2, -1)})


# ------------------------------------------------------------------------------------------ per-row write slots
@GENERATIONS
def test_per_row_write_slots_last_write_wins(generation: int) -> None:
    cache = _backend(generation).new_cache(2, 10, dynamic=False)
    key = torch.randn(2, 2, 2, 12)
    out, _ = cache.update(key, key, 0, {"cache_position": torch.tensor([[3, 3], [5, 6]])})
    assert torch.equal(out[0, :, 3], key[0, :, 1])  # duplicate index: the last write wins
    assert torch.equal(out[1, :, 5:7], key[1]) and not out[0, :, 5:7].any()


# -------------------------------------------------------------------------------------------- decode mask drop
@GENERATIONS
def test_decode_steps_drop_the_mask(generation: int) -> None:
    backend = _backend(generation)
    model = backend.model
    kwargs = _kwargs(backend, 1, 3, [3])
    out = model(**model.prepare_inputs_for_generation(torch.tensor([[5, 6, 7]]), **kwargs))
    after_prefill = model._update_model_kwargs_for_generation(out, kwargs)
    assert "attention_mask" not in after_prefill and "tokenizer_output" not in after_prefill
    assert after_prefill["position_ids"].tolist() == [[3]]  # decode starts at real_pos
    after_decode = model._update_model_kwargs_for_generation(out, after_prefill)
    assert "attention_mask" not in after_decode and after_decode["position_ids"].tolist() == [[4]]


# ----------------------------------------------------------------------------------- gather-based token placement
@GENERATIONS
def test_next_input_is_gathered_at_position_ids(generation: int) -> None:
    backend = _backend(generation)
    ids = torch.tensor([[5, 6, 7, 0, 0, 9], [5, 6, 7, 8, 2, 4]])
    kwargs = {**_kwargs(backend, 2, 6, [3, 6]), "position_ids": torch.tensor([[3], [5]])}
    inputs = backend.model.prepare_inputs_for_generation(ids, **kwargs)
    assert inputs["input_ids"].tolist() == [[0], [4]]  # column real_pos + step, not the appended tail


# ------------------------------------------------------------------------------------------ generate's mask rules
@GENERATIONS
def test_generate_mask_rules(generation: int) -> None:
    backend = _backend(generation)
    prompt = torch.tensor([5, 6, 7, 9])
    kwargs = _kwargs(backend, 1, 4, [4], slots=8)
    mask = kwargs.pop("attention_mask")
    kwargs["tokenizer_output"] = backend._tokenizer_output(torch.tensor([[4]]))
    no_cache = {k: v for k, v in kwargs.items() if k != "past_key_values"}  # isolate the mask rule
    with pytest.raises(ValueError, match="must be 2D"):
        backend.model.generate(prompt[None], attention_mask=mask, max_new_tokens=2, **no_cache)
    built = getattr(backend.model, compat.GENERATE_MASK_BUILDER)(prompt[None], backend.model.generation_config, kwargs)
    assert built.dtype == torch.bool and built.shape == (1, 1, 4, 4) and torch.equal(built[0, 0], mask[0, 0])
    stock = backend.stock_generate(prompt, 4, ())
    if compat.TRANSFORMERS_MAJOR == 4:  # transformers' own generate, no mask passed: upstream's semantics
        out = backend.model.generate(prompt[None], max_new_tokens=4, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True, pad_token_id=0, **kwargs)
        assert torch.equal(out.sequences[0, 4:], stock.tokens)
        assert torch.equal(torch.stack(out.logits)[:, 0], stock.logits)
    else:  # 5.x renames the cache kwarg to one upstream's hooks do not take
        with pytest.raises(ValueError, match="not used by the model"):
            backend.model.generate(prompt[None], max_new_tokens=4, do_sample=False, pad_token_id=0, **kwargs)


# --------------------------------------------------------------------------- bf16 SDPA depends on key length
@GENERATIONS
def test_bf16_sdpa_depends_on_key_length(generation: int) -> None:
    prompt = torch.tensor([5, 6, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41])
    diffs = {}
    for dtype in (torch.float32, torch.bfloat16):
        backend = _backend(generation, dtype)
        with torch.no_grad():
            run = backend.stock_generate(prompt, 3, ())
            padded = backend.stock_padded(prompt, run.tokens, 40, 48)
        diffs[dtype] = float(kl_rows(run.logits, padded).max())
    # fp32: padding and a longer masked key axis are (near) exact. bf16: the same layouts may round apart on a
    # host's SDPA kernels (the rounding the padded control exists to measure), or not; either way within bf16's
    # own resolution of the log-probs, never a different distribution.
    assert diffs[torch.float32] < 1e-9
    assert 0.0 <= diffs[torch.bfloat16] < 1e-2
