"""A HunyuanImage-3 checkpoint directory loads its own remote code, offline, and drives the ar harness.

``fixtures.ar_checkpoint`` writes the seeded fake upstream of each generation the way the real checkpoint ships:
safetensors, a config.json whose ``auto_map`` points at ``modeling_hunyuan_image_3.py`` beside it (plus the
common module it imports). ``harness.inputs.checkpoints`` must load it with ``trust_remote_code=True`` from the
directory (the class lives in ``transformers_modules``, not in ``fakes``), bit for bit, and ``UpstreamBackend`` must
find the directory's ``HunyuanStaticCache`` and tell the generation from the loaded model. Both real generations run on
transformers 4.x only (as the real files); on 5.x their cases are skipped with that reason, their load is refused
naming the generation, and the portable fake runs everywhere.
"""

from __future__ import annotations

import copy
import inspect
import json

import huggingface_hub.constants
import pytest
import torch

from fakes import ar_hunyuan_common
from fixtures import ar_models
from fixtures.ar_cases import prompt_ids
from fixtures.ar_checkpoint import ARCHITECTURE, auto_map, modeling_file, source_path, write_hunyuan_remote_code
from harness.ar import loop
from harness.ar.backends import UpstreamBackend, remote_code_name
from harness.ar.batch import right_padded_batch
from harness.ar.judge import judge_logp, judge_tokens, require_path
from harness.ar.policies import fp32_policies, stock_prefill_floor
from harness.ar.routing import probe_routing
from harness.ar.spy import ARForwardSpy
from harness.inputs import compat
from harness.inputs.checkpoints import CheckpointError, detect, load_model

pytestmark = pytest.mark.cpu

REMOTE_PREFIX = "transformers_modules"
TOKEN_IDS = ([[5]], [[7, 3, 11, 2]], [[9, 1, 4, 8, 6, 2, 3, 10, 12, 5, 33]], [[3, 4, 5, 6], [95, 2, 17, 40]])
ROLLOUT_LENGTHS = (11, 4, 8, 6)
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def offline():
    """The hub is unreachable by construction: HF_HUB_OFFLINE as the gpu tier's dry run sets it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read once at import
        yield


FOUR_X = compat.has_module("transformers.modeling_attn_mask_utils")
REAL_ON_5X = pytest.mark.skipif(not FOUR_X, reason="both HunyuanImage-3 generations import "
                                "transformers.modeling_attn_mask_utils, removed in transformers "
                                f"{compat.TRANSFORMERS_MAJOR}.x: 4.x only")


@pytest.fixture(scope="module", params=[pytest.param(1, marks=REAL_ON_5X), pytest.param(2, marks=REAL_ON_5X),
                                        ar_models.PORTABLE], ids=["gen1", "gen2", "portable"])
def generation(request):
    return request.param


@pytest.fixture(scope="module")
def hunyuan_dir(tmp_path_factory, generation):
    return write_hunyuan_remote_code(tmp_path_factory.mktemp("hunyuan_remote") / "HunyuanImage-3",
                                     generation=generation)


def _fake(generation: int | str):
    return ar_models.fake_upstream("moe", generation=generation)


@pytest.fixture(scope="module")
def loaded(hunyuan_dir, offline):
    return load_model(detect(hunyuan_dir), torch.float32, "cpu", trust_remote_code=True)  # the suite's own fake


def test_directory_is_a_remote_code_checkpoint(hunyuan_dir, generation):
    config = json.loads((hunyuan_dir / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE]
    assert config["auto_map"] == auto_map(generation)
    assert config["model_type"] == ar_hunyuan_common.HunyuanImage3Config.model_type
    assert (hunyuan_dir / "model.safetensors").is_file()
    assert (hunyuan_dir / modeling_file(generation)).read_text() == source_path(generation).read_text()
    assert modeling_file(generation) == ("hunyuan.py" if generation == 1 else "modeling_hunyuan_image_3.py")
    assert (hunyuan_dir / "ar_hunyuan_common.py").read_text() == inspect.getsource(ar_hunyuan_common)
    checkpoint = detect(hunyuan_dir)
    assert (checkpoint.kind, checkpoint.feeds, checkpoint.remote_code) == ("hunyuan_image3", "ar", True)
    assert checkpoint.class_name == ARCHITECTURE


def test_loaded_classes_come_from_the_directory(loaded, generation):
    module = type(loaded).__module__
    assert module.startswith(REMOTE_PREFIX) and module.endswith(modeling_file(generation).removesuffix(".py"))
    assert type(loaded).__name__ == ARCHITECTURE
    assert not isinstance(loaded, ar_hunyuan_common.HunyuanTextModel)  # not the in-repo fake
    assert type(loaded.config).__module__.startswith(REMOTE_PREFIX)
    backend = UpstreamBackend(loaded, name="hunyuan_remote")
    assert backend.generation == (2 if generation == ar_models.PORTABLE else generation)  # from what forward takes
    assert backend.cache_cls.__name__ == "HunyuanStaticCache" and backend.cache_cls.__module__ == module


def test_config_round_trips(loaded, generation):
    fake = _fake(generation).config.to_dict()
    got = loaded.config.to_dict()
    assert got["dtype"] == "float32"  # save_pretrained records the dtype the weights were written in
    for name in ("_name_or_path", "architectures", "auto_map", "dtype", "transformers_version"):  # save/load facts
        fake.pop(name, None)
        got.pop(name, None)
    assert got == fake


def test_weights_and_buffers_round_trip_bitwise(loaded, generation):
    fake = _fake(generation)
    expected = dict(fake.named_parameters()) | dict(fake.named_buffers())
    actual = dict(loaded.named_parameters()) | dict(loaded.named_buffers())
    assert sorted(actual) == sorted(expected)
    differ = [name for name, t in expected.items()
              if actual[name].dtype != t.dtype or not torch.equal(actual[name], t)]
    assert not differ, f"not bitwise after save/load: {differ}"


@pytest.mark.parametrize("ids", TOKEN_IDS, ids=lambda ids: f"{len(ids)}x{len(ids[0])}")
def test_logits_equal_the_in_memory_fake_bitwise(loaded, generation, ids):
    # from_pretrained leaves CPU weights as views into the mmap'd safetensors file (8-byte, not 64-byte,
    # aligned), and MKL picks another reduction order for some GEMM shapes on unaligned operands: same weights,
    # last-ulp different logits (seen here at 3.8e-6). A copy puts them in fresh allocator memory, as the gpu
    # tier's .to(device) does, so this compares the loaded code, weights and buffers and nothing else.
    model = copy.deepcopy(loaded)
    ids = torch.tensor(ids)
    with torch.no_grad():
        actual = UpstreamBackend(model).stock_prefill(ids)[0]
        expected = UpstreamBackend(_fake(generation)).stock_prefill(ids)[0]
    assert torch.equal(actual, expected), f"max|d| = {(actual - expected).abs().max():.3e}"


def test_batched_equals_b1_on_the_loaded_model(loaded, generation):
    """Batched equals B=1 where routing ignores the batch; generation 2's MoE weights a lone token (every B=1
    decode step) by raw probabilities, so there the rollouts differ and the routing probe names that cause."""
    backend = UpstreamBackend(loaded, name="hunyuan_remote")
    prompts = prompt_ids(ROLLOUT_LENGTHS, seed=71)
    with torch.no_grad(), ARForwardSpy(loaded) as spy:
        fast = loop.fast_rollout(backend, right_padded_batch(prompts, backend.pad_id), NEW_TOKENS)
    reference = loop.stock_rollout(backend, prompts, NEW_TOKENS)
    policies = fp32_policies(stock_prefill_floor(backend))
    verdict = judge_tokens(fast, reference, policies.tokens).merge(
        judge_logp(fast, reference, policies.logp))
    verdict = require_path(verdict, spy, len(prompts))
    routing = probe_routing(loaded)
    assert verdict.passed == routing.independent == (generation != 2), f"{verdict.message}\n{routing.describe()}"
    if generation == 2:
        assert "single-token path" in routing.describe() and "not on padding" in routing.describe()
        return
    assert fast.tokens.shape == (len(prompts), NEW_TOKENS)
    # and the loaded model generates what the in-memory fake generates
    in_memory = loop.stock_rollout(UpstreamBackend(_fake(generation)), prompts, NEW_TOKENS)
    assert torch.equal(reference.tokens, in_memory.tokens)


def test_bf16_load_keeps_upstreams_fp32_router(hunyuan_dir, offline):
    model = load_model(detect(hunyuan_dir), torch.bfloat16, "cpu", trust_remote_code=True)
    assert model.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.bfloat16
    assert {layer.mlp.wg.weight.dtype for layer in model.layers} == {torch.float32}  # built with dtype=fp32
    backend = UpstreamBackend(model, name="hunyuan_remote_bf16")
    run = backend.stock_generate(prompt_ids((6,), seed=72)[0], 3, ())
    assert run.tokens.shape == (3,) and bool(torch.isfinite(run.logits).all())
    assert run.kv.dtype == torch.bfloat16


def test_dense_kind_loads(tmp_path, offline):
    model = load_model(detect(write_hunyuan_remote_code(tmp_path / "dense", kind="dense",
                                                           generation=ar_models.PORTABLE)), torch.float32, "cpu",
                       trust_remote_code=True)
    assert type(model).__module__.startswith(REMOTE_PREFIX)
    assert model.config.num_experts == 1
    assert type(model.layers[0].mlp).__name__ == "HunyuanMLP"


@pytest.mark.parametrize("real", [1, 2])
def test_real_generations_are_refused_on_5x_naming_their_generation(tmp_path, offline, real):
    """On 5.x a generation-1 or -2 directory does not load (its code imports a removed module) and the reason names
    that generation's file; on 4.x it loads."""
    directory = write_hunyuan_remote_code(tmp_path / f"gen{real}", generation=real)
    checkpoint = detect(directory)
    if FOUR_X:
        assert type(load_model(checkpoint, torch.float32, "cpu", trust_remote_code=True)).__name__ == ARCHITECTURE
        return
    with pytest.raises(CheckpointError) as caught:
        load_model(checkpoint, torch.float32, "cpu", trust_remote_code=True)
    reason = compat.removed_module_reason(caught.value, remote_code_name(checkpoint.config))
    assert reason is not None and reason.startswith(f"HunyuanImage-3 generation {real} ({modeling_file(real)}) "
                                                    "imports transformers.modeling_attn_mask_utils")


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="kind must be 'moe' or 'dense', got 'sparse'"):
        write_hunyuan_remote_code(tmp_path / "x", kind="sparse")
    target = tmp_path / "a_file"
    target.write_text("")
    with pytest.raises(ValueError, match="a_file is a file; expected a directory"):
        write_hunyuan_remote_code(target)
