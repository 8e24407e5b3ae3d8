"""harness.inputs.compat takes the branch of the installed transformers major, and each branch matches the stack.

One test per lane: the 4.x test runs on the lowest lock, the 5.x test on the latest; the other is skipped with
the installed version as its reason. The stack-independent tests hold on both.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers
from transformers.cache_utils import StaticLayer
from transformers.generation.utils import ALL_CACHE_NAMES

from harness.inputs import compat

pytestmark = pytest.mark.cpu

_MAJOR = int(transformers.__version__.split(".")[0])


@pytest.mark.skipif(_MAJOR != 4, reason=f"transformers {transformers.__version__} is not the 4.x lane")
def test_lane_4x_takes_the_4x_branches() -> None:
    assert compat.TRANSFORMERS_MAJOR == 4
    assert compat.config_base() is transformers.PretrainedConfig
    assert compat.cache_kwarg_name() == "past_key_values"
    assert compat.lazy_init_arity() == 1
    assert compat.has_module("transformers.modeling_attn_mask_utils")
    assert not compat.diffusers_has("AutoencoderKLMiniMaxH3")
    assert "has no AutoencoderKLMiniMaxH3" in compat.path_unavailable("decode")


@pytest.mark.skipif(_MAJOR != 5, reason=f"transformers {transformers.__version__} is not the 5.x lane")
def test_lane_5x_takes_the_5x_branches() -> None:
    assert compat.TRANSFORMERS_MAJOR == 5
    assert compat.config_base() is transformers.PreTrainedConfig
    assert compat.cache_kwarg_name() == "cache"
    assert compat.lazy_init_arity() == 2
    assert not compat.has_module("transformers.modeling_attn_mask_utils")
    assert compat.diffusers_has("AutoencoderKLMiniMaxH3")
    assert compat.path_unavailable("decode") is None


def test_cache_name_is_what_generation_stores_the_cache_under() -> None:
    # upstream's _update_model_kwargs_for_generation keys the cache by the first ALL_CACHE_NAMES hit
    assert compat.cache_kwarg_name() == ALL_CACHE_NAMES[0]


def test_lazy_init_arity_matches_the_installed_signature() -> None:
    params = [p for p in inspect.signature(StaticLayer.lazy_initialization).parameters if p != "self"]
    assert len(params) == compat.lazy_init_arity()
    layer = StaticLayer(max_cache_len=5)
    key = torch.randn(2, 3, 4, 8)
    compat.lazy_init_layer(layer, key, torch.randn(2, 3, 4, 8))
    assert layer.keys.shape == (2, 3, 5, 8) and layer.values.shape == (2, 3, 5, 8)
    assert not layer.keys.any()


def test_forward_cache_kwarg_reads_the_signature() -> None:
    def remote(input_ids, past_key_values=None): ...
    def stock5(input_ids, cache=None): ...
    def neither(input_ids): ...

    assert compat.forward_cache_kwarg(remote) == "past_key_values"
    assert compat.forward_cache_kwarg(stock5) == "cache"
    with pytest.raises(TypeError, match="neither past_key_values nor cache"):
        compat.forward_cache_kwarg(neither)


def test_generate_rejects_any_passed_mask_that_is_not_2d() -> None:
    assert compat.generate_accepts_mask(None)
    assert compat.generate_accepts_mask(torch.ones(1, 4))
    assert not compat.generate_accepts_mask(torch.ones(1, 1, 4, 4))
    source = inspect.getsource(transformers.GenerationMixin.generate)
    assert compat.GENERATE_MASK_BUILDER in source or hasattr(transformers.GenerationMixin, compat.GENERATE_MASK_BUILDER)


def test_init_helpers_write_fresh_tensors() -> None:
    t = torch.empty(3, 4)
    compat.init_zeros_(t)
    assert not t.any()
    compat.init_ones_(t)
    assert bool((t == 1).all())
    compat.init_copy_(t, torch.full((3, 4), 2.0))
    assert bool((t == 2).all())
    torch.manual_seed(0)
    compat.init_normal_(t, 0.5)
    assert 0.05 < float(t.std()) < 2.0


def test_only_paths_built_on_a_missing_diffusers_class_are_unavailable() -> None:
    for path in ("replay", "ar", "attention", "demo"):
        assert compat.path_unavailable(path) is None
    assert (compat.path_unavailable("decode") is None) == compat.diffusers_has("AutoencoderKLMiniMaxH3")
