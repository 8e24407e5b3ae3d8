"""The HunyuanImage-3 remote-code contract, row by row, run against a loaded model: the real code or a fake.

docs/ar-contract.md lists what the ar harness relies on in upstream's code; ``run_contract(backend)`` checks each
row on the model behind an ``UpstreamBackend`` using only what upstream itself exposes (its forward, cache class,
generation hooks, mask builder and MoE modules), so the same rows run on a user's real checkpoint
(``scripts/check-upstream``) and on the fakes (parity/test_ar_contract.py). A row passes when the model behaves as
the contract says for its generation, and records what it measured either way.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from transformers import GenerationMixin
from transformers.generation.utils import ALL_CACHE_NAMES

from harness import compat
from harness.ar.backends import IMAGE_SLICE_FIELDS, UpstreamBackend
from harness.ar.bf16 import kl_rows
from harness.ar.routing import probe_routing

__all__ = ["ROWS", "Row", "run_contract"]


@dataclass(frozen=True)
class Row:
    number: int
    point: str
    passed: bool
    measured: str


def _device(backend: UpstreamBackend) -> torch.device:
    return backend.model.lm_head.weight.device


def _kv(backend: UpstreamBackend, rows: int, length: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, backend.kv_heads, length, backend.head_dim)
    return torch.randn(shape, generator=gen).to(_device(backend), backend.model.dtype)


def _prefill(backend: UpstreamBackend, ids: torch.Tensor, real_pos: list[int], slots: int,
             dynamic: bool) -> tuple[Any, dict[str, Any]]:
    """One prefill through upstream's hooks: (outputs, the kwargs it ran with)."""
    cache = backend.new_cache(ids.shape[0], slots, dynamic=dynamic)
    kwargs = backend.model_kwargs(torch.tensor(real_pos, device=ids.device), ids.shape[1], cache, slots)
    kwargs["attention_mask"] = backend.generation_mask(ids, kwargs)
    return backend.model(**backend.model.prepare_inputs_for_generation(ids, **kwargs)), kwargs


def _raises(kind: type[BaseException], run: Callable[[], Any]) -> str:
    try:
        run()
    except kind as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0][:90] if str(err) else ''}"
    raise AssertionError(f"expected {kind.__name__}, nothing was raised")


def rope_plumbing(backend: UpstreamBackend) -> str:
    model, device = backend.model, _device(backend)
    ids, pos = torch.tensor([[5, 6], [7, 8]], device=device), torch.arange(2, device=device)[None].expand(2, -1)
    backend.model_kwargs(torch.tensor([2, 2], device=device), 2, None, 16)  # what generate sets
    if backend.generation == 1:
        missing = _raises(TypeError, lambda: model(input_ids=ids, position_ids=pos, mode="gen_text"))
        one = backend._module.build_batch_2d_rope(seq_len=16, n_elem=backend.head_dim, image_infos=None,
                                                  device=device, base=model.config.rope_theta)
        shared = _raises(AssertionError, lambda: model(input_ids=ids, position_ids=pos, mode="gen_text",
                                                       custom_pos_emb=one))
        found = f"custom_pos_emb: none -> {missing}; one table at B=2 -> {shared}"
    else:
        shared = _raises(RuntimeError, lambda: model(input_ids=ids, position_ids=pos, mode="gen_text",
                                                     rope_image_info=None))
        found = f"rope_image_info=None at B=2 -> {shared}"
    out = model(input_ids=ids, position_ids=pos, mode="gen_text", **backend.rope_kwargs(2, 16, device))
    assert tuple(out.logits.shape) == (2, 2, backend.vocab_size), tuple(out.logits.shape)
    return f"generation {backend.generation}: {found}; per-row RoPE -> logits {tuple(out.logits.shape)}"


def cache_kwarg_name(backend: UpstreamBackend) -> str:
    ids = torch.tensor([[5, 6, 7]], device=_device(backend))
    out, kwargs = _prefill(backend, ids, [3], 16, dynamic=True)
    updated = backend.model._update_model_kwargs_for_generation(out, kwargs)
    name = compat.cache_kwarg_name()
    assert ALL_CACHE_NAMES[0] == name and updated.get(name) is kwargs["past_key_values"], sorted(updated)
    return f"ALL_CACHE_NAMES[0] = {ALL_CACHE_NAMES[0]}; kwargs after prefill = {', '.join(sorted(updated))}"


def lazy_init_arity(backend: UpstreamBackend) -> str:
    cache = backend.new_cache(1, 8, dynamic=False)
    layer_cls = type(cache.layers[0])
    original, calls = layer_cls.lazy_initialization, []

    def record(self: Any, *tensors: torch.Tensor) -> Any:
        calls.append(len(tensors))
        return original(self, *tensors)

    key = _kv(backend, 1, 3)
    with mock.patch.object(layer_cls, "lazy_initialization", record):
        cache.update(key, key, 0, {"cache_position": torch.arange(3, device=key.device)})
    assert calls == [1], f"lazy_initialization called with {calls} tensor(s); the real code passes the key only"
    return f"lazy_initialization called with {calls[0]} tensor (installed arity {compat.lazy_init_arity()})"


def returned_cache_shapes(backend: UpstreamBackend) -> str:
    key = _kv(backend, 1, 4)
    slots = torch.arange(4, device=key.device)[None]
    static, _ = backend.new_cache(1, 10, dynamic=False).update(key, key, 0, {"cache_position": slots})
    dynamic, _ = backend.new_cache(1, 10, dynamic=True).update(key, key, 0, {"cache_position": slots})
    assert static.shape[2] == 10 and not static[:, :, 4:].any(), tuple(static.shape)
    assert dynamic.shape[2] == 4 and torch.equal(dynamic, key), tuple(dynamic.shape)
    return f"4 writes into 10 slots: static {tuple(static.shape)} (zeros past slot 3), dynamic {tuple(dynamic.shape)}"


def batched_dynamic_asserts(backend: UpstreamBackend) -> str:
    key = _kv(backend, 2, 4)
    cache = backend.new_cache(2, 10, dynamic=True)
    slots = torch.arange(4, device=key.device)[None].expand(2, -1)
    raised = _raises(AssertionError, lambda: cache.update(key, key, 0, {"cache_position": slots}))
    return f"B=2 dynamic 2-D write -> {raised}"


def per_row_write_slots(backend: UpstreamBackend) -> str:
    key = _kv(backend, 2, 2)
    cache = backend.new_cache(2, 10, dynamic=False)
    out, _ = cache.update(key, key, 0, {"cache_position": torch.tensor([[3, 3], [5, 6]], device=key.device)})
    assert torch.equal(out[0, :, 3], key[0, :, 1]), "duplicate slot: the last write must win"
    assert torch.equal(out[1, :, 5:7], key[1]) and not out[0, :, 5:7].any()
    return "row 0 slots [3, 3] hold the second write; row 1 slots 5, 6 hold its keys, row 0 none there"


def decode_mask_drop(backend: UpstreamBackend) -> str:
    model = backend.model
    ids = torch.tensor([[5, 6, 7]], device=_device(backend))
    out, kwargs = _prefill(backend, ids, [3], 16, dynamic=True)
    prefill = model._update_model_kwargs_for_generation(out, kwargs)
    decode = model._update_model_kwargs_for_generation(out, compat.remote_code_kwargs(prefill))
    assert "attention_mask" not in prefill and "tokenizer_output" not in prefill, sorted(prefill)
    assert "attention_mask" not in decode
    positions = (prefill["position_ids"].tolist(), decode["position_ids"].tolist())
    assert positions == ([[3]], [[4]]), positions
    return f"no mask after the prefill or a decode step; position_ids {positions[0]} then {positions[1]}"


def gather_at_position_ids(backend: UpstreamBackend) -> str:
    device = _device(backend)
    ids = torch.tensor([[5, 6, 7, 0, 0, 9], [5, 6, 7, 8, 2, 4]], device=device)
    kwargs = backend.model_kwargs(torch.tensor([3, 6], device=device), 6, backend.new_cache(2, 16, False), 16)
    kwargs["position_ids"] = torch.tensor([[3], [5]], device=device)
    fed = backend.model.prepare_inputs_for_generation(ids, **kwargs)["input_ids"].tolist()
    assert fed == [[0], [4]], fed
    return f"buffer [5, 6, 7, 0, 0, 9] at position 3 feeds {fed[0]} (the pad, not the appended 9)"


def generate_mask_rules(backend: UpstreamBackend) -> str:
    model, device = backend.model, _device(backend)
    prompt = torch.tensor([[5, 6, 7, 9]], device=device)
    kwargs = backend.model_kwargs(torch.tensor([4], device=device), 4, None, 8)
    built = backend.generation_mask(prompt, kwargs)
    causal = torch.ones(4, 4, dtype=torch.bool, device=device).tril()
    assert built.dtype == torch.bool and tuple(built.shape) == (1, 1, 4, 4) and torch.equal(built[0, 0], causal)
    no_cache = {k: v for k, v in kwargs.items() if k != "past_key_values"}
    rule = _raises(ValueError, lambda: GenerationMixin.generate(model, prompt, attention_mask=built,
                                                                max_new_tokens=2, **no_cache))
    assert "must be 2D" in rule, rule
    found = f"4-D mask -> {rule}; none passed: the builder's bool [1, 1, 4, 4] causal mask"
    if compat.TRANSFORMERS_MAJOR == 4:  # transformers' own generate loop over upstream's hooks
        stock = backend.stock_generate(prompt[0], 4, ())
        cache = backend.new_cache(1, 8, dynamic=True)
        kwargs = backend.model_kwargs(torch.tensor([4], device=device), 4, cache, 8)
        out = GenerationMixin.generate(model, prompt, max_new_tokens=4, do_sample=False, output_logits=True,
                                       return_dict_in_generate=True, pad_token_id=backend.pad_id, **kwargs)
        tokens, logits = out.sequences[0, 4:], torch.stack(out.logits)[:, 0].float()
        assert torch.equal(tokens, stock.tokens), (tokens.tolist(), stock.tokens.tolist())
        found += (f"; generate tokens {tokens.tolist()} == the backend's stock loop, logits max|d| "
                  f"{float((logits - stock.logits).abs().max()):.1e}")
    return found


def bf16_sdpa_key_length(backend: UpstreamBackend) -> str:
    prompt = torch.tensor([5, 6, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41], device=_device(backend)) % (
        backend.vocab_size - 1) + 1
    kls = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = copy.deepcopy(backend.model).to(dtype)
        other = UpstreamBackend(model, cache_cls=backend.cache_cls)
        run = other.stock_generate(prompt, 3, ())
        kls[dtype] = float(kl_rows(run.logits, other.stock_padded(prompt, run.tokens, 40, 48)).max())
    assert kls[torch.float32] < 1e-9 and kls[torch.bfloat16] > 1e3 * max(kls[torch.float32], 1e-12), kls
    return (f"prompt 13 padded to 40 in a 48-slot cache vs unpadded: KL fp32 {kls[torch.float32]:.1e}, "
            f"bf16 {kls[torch.bfloat16]:.1e}")


def what_generate_sets(backend: UpstreamBackend) -> str:
    model = copy.deepcopy(backend.model)
    device = _device(backend)
    ids, pos = torch.tensor([[5, 6]], device=device), torch.arange(2, device=device)[None]
    rope = backend.rope_kwargs(1, 16, device)
    model.__dict__.pop("post_token_len", None)
    if backend.generation == 1:
        model(input_ids=ids, position_ids=pos, mode="gen_text", **rope)
        return "generation 1's forward reads nothing only generate sets"
    missing = _raises(AttributeError, lambda: model(input_ids=ids, position_ids=pos, mode="gen_text", **rope))
    assert "post_token_len" in missing, missing
    UpstreamBackend(model, cache_cls=backend.cache_cls).model_kwargs(torch.tensor([2], device=device), 2, None, 16)
    model(input_ids=ids, position_ids=pos, mode="gen_text", **rope)
    return f"forward before generate -> {missing}; with post_token_len=None (text rows) it runs"


def mask_builder_inputs(backend: UpstreamBackend) -> str:
    model = backend.model
    build = getattr(model, compat.GENERATE_MASK_BUILDER)
    ids = torch.ones(1, 6, dtype=torch.long, device=_device(backend))
    no_kwargs = _raises(KeyError, lambda: build(ids, model.generation_config, {}))
    empty = {name: [[]] for name in IMAGE_SLICE_FIELDS}
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    read, blocks = [], []
    for name in IMAGE_SLICE_FIELDS:
        without = SimpleNamespace(real_pos=torch.tensor([[6]]), **{k: v for k, v in empty.items() if k != name})
        try:
            build(ids, model.generation_config, {"tokenizer_output": without})
        except AttributeError:
            read.append(name)
        output = SimpleNamespace(real_pos=torch.tensor([[6]]), **{**empty, name: [[slice(1, 4)]]})
        if not torch.equal(build(ids, model.generation_config, {"tokenizer_output": output})[0, 0].cpu(), causal):
            blocks.append(name)
    # generation 2's image processor reads every choice of cond_image_type "vae_vit" (joint slices included) and
    # gives full attention to those of cond_token_attn_type "full": vae + vit
    full = ["joint_image_slices", "gen_image_slices"] if backend.generation == 1 else [
        "gen_image_slices", "vae_image_slices", "vit_image_slices"]
    expected = full if backend.generation == 1 else [*full, "joint_image_slices"]
    assert (sorted(read), sorted(blocks)) == (sorted(expected), sorted(full)), (read, blocks)
    where = build(ids, model.generation_config, {"tokenizer_output": SimpleNamespace(real_pos=None, **empty)}).device
    return (f"model_kwargs {{}} -> {no_kwargs}; reads {', '.join(sorted(read))}; full blocks over "
            f"{', '.join(sorted(blocks))}; built on {where.type}")


def moe_routing(backend: UpstreamBackend) -> str:
    probe = probe_routing(backend.model)
    if not probe.layers:
        return probe.describe()
    drops = bool(getattr(backend.model.config, "moe_drop_tokens", False))
    lone = max(probe.lone_token) > probe.threshold
    rows = max(probe.own_row) > probe.threshold
    expected = (drops, drops) if backend.generation == 1 else (True, False)
    assert (lone, rows) == expected, probe.describe()
    return probe.describe()


ROWS: tuple[tuple[int, str, Callable[[UpstreamBackend], str]], ...] = (
    (1, "RoPE plumbing", rope_plumbing),
    (2, "cache kwarg name per major", cache_kwarg_name),
    (3, "lazy-init arity", lazy_init_arity),
    (4, "returned cache shapes", returned_cache_shapes),
    (5, "B>1 dynamic-cache assert", batched_dynamic_asserts),
    (6, "per-row write slots", per_row_write_slots),
    (7, "decode-step mask drop", decode_mask_drop),
    (8, "gather-based token placement", gather_at_position_ids),
    (9, "generate's mask rules", generate_mask_rules),
    (10, "bf16 SDPA depends on key length", bf16_sdpa_key_length),
    (11, "what generate sets", what_generate_sets),
    (12, "mask builder reads tokenizer_output", mask_builder_inputs),
    (13, "MoE routing", moe_routing),
)


@torch.no_grad()
def run_contract(backend: UpstreamBackend, numbers: tuple[int, ...] | None = None) -> list[Row]:
    """Run the rows (all, or ``numbers``) on ``backend``'s model; a row that raises fails with what it raised."""
    rows = []
    for number, point, check in ROWS:
        if numbers is not None and number not in numbers:
            continue
        try:
            rows.append(Row(number, point, True, check(backend)))
        except Exception as err:  # noqa: BLE001 - a contract row reports whatever broke it
            detail = str(err).splitlines()[0][:300] if str(err) else ""
            rows.append(Row(number, point, False, f"{type(err).__name__}: {detail}"))
    return rows
