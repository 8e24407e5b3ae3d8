"""The backends' own paths in-process: generation detection, generation-1 RoPE plumbing, what the stock paths hand
upstream's hooks, the stock padded runs the bf16 control uses, the transformers hole layout and each stock loop's
forward count."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import sys
import types

import pytest
import torch

from fixtures import ar_models
from fixtures.ar_cases import prompt_ids
from harness.ar import loop
from harness.ar.backends import (
    IMAGE_SLICE_FIELDS,
    TransformersBackend,
    UpstreamBackend,
    model_mask,
    remote_code_generation,
    remote_code_name,
    upstream_generation,
)
from harness.ar.batch import right_padded_batch
from harness.ar.policies import stock_prefill_floor
from harness.inputs import compat
from harness.judging.compare import max_abs_diff
from tests.ar.test_bf16_policy import bf16_backend
from tests.ar.test_loop import OnDevice

pytestmark = pytest.mark.cpu

PAD = ar_models.PAD_ID
_NO_MASK_UTILS = "transformers.modeling_attn_mask_utils"
FOUR_X = pytest.mark.skipif(not compat.has_module(_NO_MASK_UTILS),
                            reason=f"both real generations import {_NO_MASK_UTILS}: transformers 4.x only")
STRICT_FAKES = pytest.mark.parametrize("name", ["fake", pytest.param("fake_gen1", marks=FOUR_X),
                                                pytest.param("fake_gen2", marks=FOUR_X)])


@functools.cache
def gen1_backend() -> UpstreamBackend:
    """The generation-1 fake (``hunyuan.py``'s plumbing) on the portable fake's weights.

    Generation 1 imports a module transformers 5.x removed; only that import is stood in for while the fake
    loads, and its cache takes the installed transformers' lazy-init arity (the portable fake's cache), so its
    RoPE plumbing (``custom_pos_emb`` built by the caller) runs on any stack."""
    stand_in = not compat.has_module(_NO_MASK_UTILS)  # 4.x: the real module loads
    if stand_in:
        sys.modules[_NO_MASK_UTILS] = types.ModuleType(_NO_MASK_UTILS)
    try:
        gen1 = importlib.import_module("fakes.ar_hunyuan_gen1")
    finally:
        if stand_in:
            del sys.modules[_NO_MASK_UTILS]
    portable = ar_models.fake_upstream("moe")
    model = gen1.HunyuanImage3ForCausalMM(portable.config)
    model.load_state_dict(portable.state_dict())
    cache_cls = sys.modules[type(portable).__module__].HunyuanStaticCache
    return UpstreamBackend(model.eval(), name="fake_gen1", cache_cls=cache_cls)


# ---------------------------------------------------------------------------------------- generation detection


def _stand_in(module: str, forward) -> object:
    return type("StandIn", (), {"forward": forward, "__module__": module})()


def _gen1_forward(self, input_ids, custom_pos_emb=None):
    return input_ids


def _gen2_forward(self, input_ids, rope_image_info=None):
    return input_ids


def _plain_forward(self, input_ids):
    return input_ids


def test_upstream_generation_reads_the_forward_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("ar_stand_in_module")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert upstream_generation(ar_models.fake_upstream("moe")) == 2
    assert upstream_generation(_stand_in(module.__name__, _gen2_forward)) == 2
    with pytest.raises(TypeError, match="StandIn.forward takes custom_pos_emb but its module has no "
                                        "build_batch_2d_rope to build it"):
        upstream_generation(_stand_in(module.__name__, _gen1_forward))
    module.build_batch_2d_rope = None  # present but not callable
    with pytest.raises(TypeError, match="no build_batch_2d_rope"):
        upstream_generation(_stand_in(module.__name__, _gen1_forward))
    module.build_batch_2d_rope = lambda **kwargs: None
    assert upstream_generation(_stand_in(module.__name__, _gen1_forward)) == 1
    with pytest.raises(TypeError, match=r"StandIn.forward takes neither custom_pos_emb \(HunyuanImage-3 "
                                        r"generation 1\) nor rope_image_info \(generation 2\)"):
        upstream_generation(_stand_in(module.__name__, _plain_forward))


# ---------------------------------------------------------------------------------------- generation 1 plumbing


def test_generation1_gets_per_row_rope_tables_from_its_module() -> None:
    backend = gen1_backend()
    assert backend.generation == 1
    kwargs = backend.rope_kwargs(3, 16, torch.device("cpu"))
    assert list(kwargs) == ["custom_pos_emb"]
    cos, sin = kwargs["custom_pos_emb"]
    want_cos, want_sin = backend._module.build_batch_2d_rope(16, 12, [[], [], []], torch.device("cpu"), 10000.0)
    assert cos.shape == (3, 16, 12) and torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert ar_models.backend("fake").rope_kwargs(2, 16, torch.device("cpu")) == {"rope_image_info": [[], []]}


def test_generation1_paths_equal_the_portable_fake_on_the_same_weights() -> None:
    """Same weights, same RoPE tables: only the plumbing differs, so every stock path agrees bit for bit."""
    gen1, gen2 = gen1_backend(), ar_models.backend("fake")
    prompt = prompt_ids([7], seed=41)[0]
    with torch.no_grad():
        assert torch.equal(gen1.full_forward(prompt), gen2.full_forward(prompt))
        run1, run2 = gen1.stock_generate(prompt, 3, ()), gen2.stock_generate(prompt, 3, ())
        assert torch.equal(run1.tokens, run2.tokens) and torch.equal(run1.logits, run2.logits)
        assert torch.equal(run1.kv, run2.kv)
        padded1 = gen1.stock_padded(prompt, run1.tokens, 10, 13)
    assert max_abs_diff(padded1, run1.logits) < 1e-5
    batch = right_padded_batch([prompt, *prompt_ids([4], seed=42)], PAD)
    fast = loop.fast_rollout(gen1, batch, 3)
    assert torch.equal(fast.tokens[0], run1.tokens) and max_abs_diff(fast.logits[0], run1.logits) < 1e-5


def test_tokenizer_output_has_one_empty_image_list_per_row() -> None:
    """Every slice list either generation's mask builder reads: generation 1's joint and gen slices, generation
    2's vae and vit slices (its image processor's ``prepare_full_attn_slices``)."""
    out = ar_models.backend("fake")._tokenizer_output(torch.tensor([[3], [5], [2]]))
    assert out.real_pos.tolist() == [[3], [5], [2]]
    assert set(IMAGE_SLICE_FIELDS) == {"joint_image_slices", "gen_image_slices", "vae_image_slices",
                                       "vit_image_slices"}
    assert all(getattr(out, name) == [[], [], []] for name in IMAGE_SLICE_FIELDS)


# ---------------------------------------------------------------------------- what the stock paths hand upstream


@STRICT_FAKES
def test_every_stock_path_hands_upstream_what_generate_hands_it(name: str) -> None:
    """The fp32 floor of the gpu tier (gpu/ar.py -> verdicts.stock_prefill_floor -> backend.stock_prefill) and
    every other stock path call upstream's mask builder with ``model_kwargs`` carrying ``tokenizer_output`` and
    run its forward with ``post_token_len`` set, as upstream's ``generate`` does. The strict fakes demand both as
    the real code does, so a harness that hands the builder ``{}`` fails here with the real code's
    ``KeyError: 'tokenizer_output'``, and one that skips what ``generate`` sets with its ``AttributeError``."""
    backend = ar_models.backend(name)
    prompt = prompt_ids([6], seed=50)[0]
    with torch.no_grad():
        for run in (lambda: stock_prefill_floor(backend), lambda: backend.full_forward(prompt),
                    lambda: backend.stock_generate(prompt, 2, ()),
                    lambda: backend.stock_padded(prompt, torch.tensor([3, 4]), 8, 10)):
            backend.model.__dict__.pop("post_token_len", None)  # as loaded: only upstream's generate sets it
            run()
        floor = stock_prefill_floor(backend)
    assert floor.floor("logp") > 0 and floor.floor("kv") > 0


@pytest.mark.parametrize(("auto_map", "generation"), [
    ({"AutoModelForCausalLM": "hunyuan.HunyuanImage3ForCausalMM"}, 1),
    ({"AutoModelForCausalLM": "modeling_hunyuan_image_3.HunyuanImage3ForCausalMM"}, 2),
    ({"AutoModelForCausalLM": "/code/hi3--modeling_hunyuan_image_3.HunyuanImage3ForCausalMM"}, 2),
    ({"AutoModelForCausalLM": "modeling_other.OtherForCausalLM"}, None),
    ({}, None),
])
def test_remote_code_generation_is_read_from_the_auto_map(auto_map: dict, generation: int | None) -> None:
    assert remote_code_generation({"auto_map": auto_map}) == generation


@pytest.mark.parametrize("auto_map", [{"AutoModelForCausalLM": "modeling_other.OtherForCausalLM"}, {}])
def test_a_refusal_for_unrecognised_remote_code_names_the_checkpoints_code(auto_map: dict,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Remote code that is no HunyuanImage-3 generation is still named in the transformers 5.x refusal: the same
    subject the refusal takes when no name is given, never a missing one."""
    monkeypatch.setattr(compat, "TRANSFORMERS_MAJOR", 5)
    err = ModuleNotFoundError(f"No module named '{_NO_MASK_UTILS}'", name=_NO_MASK_UTILS)
    reason = compat.removed_module_reason(err, remote_code_name({"auto_map": auto_map}))
    assert reason == compat.removed_module_reason(err)
    assert reason is not None and reason.startswith(f"the checkpoint's remote code imports {_NO_MASK_UTILS},")


# ---------------------------------------------------------------------------------------- stock padded runs


@pytest.mark.parametrize("name", ["fake", "qwen3"])
@pytest.mark.parametrize("width", [5, 9])
def test_stock_padded_fp32_equals_the_unpadded_stock_run(name: str, width: int) -> None:
    """fp32: right-padding to ``width`` and a longer masked key axis change nothing beyond rounding, at every
    teacher-forced step (width 5 = no padding: the token buffer must grow past the prompt)."""
    backend = ar_models.backend(name)
    prompt = prompt_ids([5], seed=43)[0]
    with torch.no_grad():
        run = backend.stock_generate(prompt, 4, ())
        padded = backend.stock_padded(prompt, run.tokens, width, width + 4)
    assert padded.shape == (4, ar_models.VOCAB) and padded.dtype == torch.float32
    assert max_abs_diff(padded, run.logits) < 1e-5


def test_stock_padded_masks_each_query_as_transformers_documents() -> None:
    """transformers takes a 4-D mask as ``[batch, 1, queries, keys]``: a kernel that reads it literally (the
    read-safe one, like a flash kernel skipping masked blocks) gets one mask row per query and the same
    teacher-forced logits as the unpadded stock run, at the batch's row count."""
    backend = ar_models.backend("qwen3", "read_safe")
    prompt = prompt_ids([5], seed=43)[0]
    with torch.no_grad():
        run = backend.stock_generate(prompt, 3, ())
        padded = backend.stock_padded(prompt, run.tokens, 8, 11, rows=2, row=1)
    assert padded.shape == (3, ar_models.VOCAB) and max_abs_diff(padded, run.logits) < 1e-5


@pytest.mark.parametrize("name", ["fake", "qwen3"])
@pytest.mark.parametrize(("rows", "row"), [(2, 2), (2, -1), (0, 0)])
def test_a_stock_control_batch_refuses_a_row_it_does_not_hold(name: str, rows: int, row: int) -> None:
    backend = ar_models.backend(name)
    prompt = prompt_ids([5], seed=43)[0]
    with pytest.raises(ValueError, match=f"rows >= 1 and 0 <= row < rows, got rows={rows}, row={row}"):
        backend.stock_padded(prompt, torch.tensor([3, 4]), 8, 10, rows=rows, row=row)
    with torch.no_grad():
        last = backend.stock_padded(prompt, torch.tensor([3, 4]), 8, 10, rows=3, row=2)
    assert last.shape == (2, ar_models.VOCAB)


@pytest.mark.parametrize("name", ["fake", "qwen3"])
def test_bf16_stock_runs_return_fp32_logits_and_kv(name: str) -> None:
    backend = bf16_backend(name)
    prompt = prompt_ids([6], seed=44)[0]
    with torch.no_grad():
        run = backend.stock_generate(prompt, 3, ())
        padded = backend.stock_padded(prompt, run.tokens, 9, 12)
        logits, kv = backend.stock_prefill(prompt[None])
    assert (run.logits.dtype, padded.dtype, logits.dtype, kv.dtype) == (torch.float32,) * 4
    assert run.kv.dtype == torch.bfloat16  # the stock run's KV as the model wrote it


# ---------------------------------------------------------------------------------------- stock loops


@pytest.mark.parametrize("name", ["qwen3", "fake"])
def test_stock_generate_runs_one_forward_per_token(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No EOS: exactly ``max_new_tokens`` forwards; an EOS at step 1 stops after 2 (the loop never overruns)."""
    backend = ar_models.backend(name)
    seam = "_run" if name == "qwen3" else "_step"
    real = getattr(backend, seam)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        if len(calls) > 4:
            raise AssertionError("stock_generate ran past max_new_tokens forwards")
        return real(*args, **kwargs)

    monkeypatch.setattr(backend, seam, counted)
    prompt = prompt_ids([6], seed=46)[0]
    with torch.no_grad():
        run = backend.stock_generate(prompt, 3, ())
        assert len(calls) == 3 and run.tokens.shape == (3,) and run.logits.shape == (3, ar_models.VOCAB)
        calls.clear()
        stopped = backend.stock_generate(prompt, 4, (int(run.tokens[1]),))
    assert len(calls) == 2 and torch.equal(stopped.tokens, run.tokens[:2])
    assert stopped.kv.shape[-2] == prompt.numel() + 1  # the last sampled token is never fed back


def test_stock_padded_writes_at_b1_where_the_layout_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstream: one B=1 static cache of the batch's length. Transformers: prefill slots [0, width), then
    teacher-forced token k at shared slot ``width + k`` (the hole layout's write index)."""
    prompt, tokens = prompt_ids([5], seed=47)[0], torch.tensor([3, 4, 6, 8])
    fake = ar_models.backend("fake")
    made = []
    real_new_cache = fake.new_cache
    monkeypatch.setattr(fake, "new_cache", lambda *args, **kw: made.append((args, kw)) or real_new_cache(*args, **kw))
    with torch.no_grad():
        fake.stock_padded(prompt, tokens, 8, 12)
    assert made == [((1, 12), {"dynamic": False})]
    qwen = ar_models.backend("qwen3")
    slots = []
    real_run = qwen._run
    monkeypatch.setattr(qwen, "_run", lambda ids, mask, positions, cache, write=None: slots.append(
        (write.tolist(), positions.tolist())) or real_run(ids, mask, positions, cache, write))
    with torch.no_grad():
        qwen.stock_padded(prompt, tokens, 8, 12)
    assert slots == [(list(range(8)), [list(range(8))]), ([8], [[5]]), ([9], [[6]]), ([10], [[7]])]


def test_stock_runs_hand_back_fp32_logits_whatever_dtype_the_model_returns() -> None:
    """Remote code may return its lm_head's bf16 logits; the stock runs' logits are fp32 either way."""
    backend = bf16_backend("fake")

    def bf16_logits(module, args, kwargs, out):
        return dataclasses.replace(out, logits=out.logits.bfloat16())

    handle = backend.model.register_forward_hook(bf16_logits, with_kwargs=True)
    try:
        prompt = prompt_ids([6], seed=48)[0]
        with torch.no_grad():
            assert backend.full_forward(prompt).dtype == torch.bfloat16  # the hook took effect
            run = backend.stock_generate(prompt, 2, ())
            padded = backend.stock_padded(prompt, run.tokens, 8, 10)
            logits, _ = backend.stock_prefill(prompt[None])
    finally:
        handle.remove()
    assert (run.logits.dtype, padded.dtype, logits.dtype) == (torch.float32,) * 3


@pytest.mark.parametrize("name", ["fake", "qwen3"])
def test_stock_prefill_brings_device_logits_and_kv_to_the_host(name: str) -> None:
    backend = ar_models.backend(name)

    def on_device(module, args, kwargs, out):
        """The forward ran on the accelerator: its logits and the cache it filled live there."""
        for layer in kwargs.get("past_key_values", kwargs.get("cache")).layers:
            layer.keys, layer.values = layer.keys.as_subclass(OnDevice), layer.values.as_subclass(OnDevice)
        return dataclasses.replace(out, logits=out.logits.as_subclass(OnDevice))

    handle = backend.model.register_forward_hook(on_device, with_kwargs=True)
    try:
        with torch.no_grad():
            logits, kv = backend.stock_prefill(prompt_ids([5, 5], seed=49)[0].expand(2, -1))
    finally:
        handle.remove()
    assert type(logits) is torch.Tensor and type(kv) is torch.Tensor
    assert logits.shape == (2, 5, ar_models.VOCAB) and kv.shape[0] == 2 and kv.shape[-2] == 5


class TakesWriteSlots(torch.nn.Module):
    """A causal LM stand-in whose forward takes ``cache_position`` (as 4.x models do), recording what it got."""

    def __init__(self) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(pad_token_id=0, vocab_size=5, num_key_value_heads=1, head_dim=2)
        self.handed: list[dict] = []

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=None, past_key_values=None,
                cache_position=None):
        self.handed.append({"cache_position": cache_position, "use_cache": use_cache})
        return types.SimpleNamespace(logits=torch.zeros(*input_ids.shape, 5))


def test_a_forward_that_takes_write_slots_is_handed_them_and_only_when_there_are_some() -> None:
    model = TakesWriteSlots()
    backend = TransformersBackend(model, "stand-in")
    slots = torch.tensor([7])
    backend._run(torch.zeros(1, 1, dtype=torch.long), None, None, "a cache", slots)
    backend._run(torch.zeros(1, 1, dtype=torch.long), None, None, None)
    assert model.handed[0] == {"cache_position": slots, "use_cache": True}
    assert model.handed[1] == {"cache_position": None, "use_cache": False}



def test_an_eager_model_gets_its_bool_masks_as_minus_infinity_biases_and_every_other_model_as_given() -> None:
    mask = torch.tensor([[[[True, False, True]]]])
    eager = ar_models.transformers_model("qwen3", "eager")
    biased = model_mask(eager, mask)
    assert biased.dtype == eager.dtype and biased.tolist() == [[[[0.0, -math.inf, 0.0]]]]
    assert model_mask(ar_models.backend("qwen3", "eager", "bfloat16").model, mask).dtype == torch.bfloat16
    for model in (ar_models.transformers_model("qwen3"), ar_models.transformers_model("qwen3", "read_safe"), object()):
        assert model_mask(model, mask) is mask  # SDPA, a kernel that takes bool, a model without a config
    additive = torch.zeros(1, 1, 1, 3)
    assert model_mask(eager, additive) is additive and model_mask(eager, None) is None


@pytest.mark.parametrize("model", ["qwen3", "hunyuan_moe"])
def test_an_eager_model_under_the_backends_masks_computes_what_sdpa_does(model: str) -> None:
    """A right-padded batch through both kernels' backends: bool 0/1 added to eager scores would admit the pads."""
    batch = right_padded_batch(prompt_ids([4, 7], seed=61), PAD)
    sdpa = loop.fast_rollout(ar_models.backend(model), batch, 3)
    eager = loop.fast_rollout(ar_models.backend(model, "eager"), batch, 3)
    assert torch.equal(sdpa.tokens, eager.tokens) and max_abs_diff(sdpa.logp, eager.logp) < 1e-5
    with torch.no_grad():
        raw = ar_models.transformers_model(model, "eager")(input_ids=batch.input_ids,
                                                           attention_mask=batch.attention_mask).logits
    assert max_abs_diff(raw[0, 3], sdpa.logits[0, 0]) > 1e-2  # row 0's pads seen: the bool mask taken as 0 / 1


@pytest.mark.parametrize("name", ["fake", "qwen3"])
def test_under_the_eager_kernel_a_query_row_that_admits_no_key_is_nan(name: str) -> None:
    backend = ar_models.backend(name, "eager")
    prompt = prompt_ids([4], seed=62)[0]
    cache = backend.new_cache(1, 4, dynamic=False)
    mask = torch.ones(4, 4, dtype=torch.bool).tril()[None, None].clone()
    mask[..., 2, :] = False
    state = loop.init_state(backend, right_padded_batch([prompt], PAD), 1)
    state.cache = cache
    backend.begin(state)
    with torch.no_grad():
        logits = backend.prefill(state, mask)
    # row 2 is NaN after the first layer, and its KV reaches every row in the next: 0 x NaN where masked out
    assert bool(logits.isnan().all())
    mask[..., 2, 0] = True
    with torch.no_grad():
        state.cache = backend.new_cache(1, 4, dynamic=False)
        backend.begin(state)
        assert bool(backend.prefill(state, mask).isfinite().all())


def test_the_prefill_floor_scales_by_the_fp64_log_softmax_of_the_batched_logits():
    """``logp_scale`` is the compared log-probs' own magnitude, taken in fp64 (an fp32 log-softmax rounds it)."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(4, 6, 97, generator=gen) * 9.0).float()

    class Stub:
        name, pad_id, vocab_size = "stub", 0, 97

        def stock_prefill(self, ids):
            rows = ids.shape[0]
            return (logits[:rows] if rows > 1 else logits[int(ids[0, 0]) % 4: int(ids[0, 0]) % 4 + 1],
                    torch.zeros(rows, 1, 1, 6, 2))

    floor = stock_prefill_floor(Stub(), rows=4, length=6)
    expected = float(torch.log_softmax(logits.double(), -1).abs().max())
    assert floor.logp_scale == expected
    assert float(torch.log_softmax(logits, -1).abs().max()) != expected  # the fp32 one differs: the test can fail
