"""The catalogues follow the registries: what an installed package registers (a replay family, an AR
backend's tiny models, an attention kernel) is what the generated catalogues enumerate."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest

from fixtures import ar_models
from fixtures.replay_families import family_ids, family_names, family_traits
from harness.ar.backends import TransformersBackend
from harness.attention import kernels
from harness.plugins import entry_points as plugins
from harness.replay.families import SHIPPED

pytestmark = pytest.mark.cpu


def test_every_shipped_replay_family_is_enumerated_with_its_layout():
    assert set(family_names()) >= {family.name for family in SHIPPED}
    assert family_traits("flux").branch_independent == ("pooled_projections",)
    assert family_traits("cogview4").fused and not family_traits("cogview4").branch_independent
    assert "replay.flux.cfg2.log_probs" in family_ids("cfg2.log_probs", fused=True, branch_independent=True)
    assert "replay.sd3.cfg2.log_probs" not in family_ids("cfg2.log_probs", fused=True)


def _tiny_qwen3(attn_implementation: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(vocab_size=ar_models.VOCAB, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                        head_dim=8, pad_token_id=ar_models.PAD_ID,
                                        attn_implementation=attn_implementation))


class InstalledBackend(TransformersBackend):
    """An installed AR backend that declares one tiny model for the CPU catalogue."""

    tiny_models: ClassVar[dict] = {"installed_qwen3": _tiny_qwen3}


def test_an_installed_ar_backend_brings_its_tiny_models_into_the_catalogue():
    plugins.AR_BACKENDS.register("installed_test", InstalledBackend, origin="tests")
    try:
        assert ar_models.catalogue_models() == (*ar_models.SHIPPED_MODELS, "installed_qwen3")
        built = ar_models.backend.__wrapped__("installed_qwen3")
        assert isinstance(built, InstalledBackend) and built.name == "installed_qwen3"
        assert not any(p.isnan().any() for p in built.model.parameters())
    finally:
        plugins.AR_BACKENDS.unregister("installed_test")
    assert ar_models.catalogue_models() == ar_models.SHIPPED_MODELS


def _registered_kernel(query, key, value, layout, *, scale=None):
    """A bare registered kernel (the reference itself)."""
    return kernels.get_kernel("sdpa")(query, key, value, layout, scale=scale)


def test_a_registered_attention_kernel_is_judged_by_the_catalogue():
    # an installed kernel that judges rather than gets judged (its own reference) stays out, and a shipped
    # kernel (registered too) is listed once, in the shipped order
    own_reference = dataclasses.replace(kernels.KernelSpec.from_callable("installed_reference_test",
                                                                         _registered_kernel), under_test=False)
    plugins.ATTENTION_KERNELS.register("installed_kernel_test", _registered_kernel, origin="tests")
    plugins.ATTENTION_KERNELS.register("installed_reference_test", own_reference, origin="tests")
    try:
        assert kernels.kernels_under_test() == ("decomposed", "flex", "block_padded", "installed_kernel_test")
    finally:
        plugins.ATTENTION_KERNELS.unregister("installed_kernel_test")
        plugins.ATTENTION_KERNELS.unregister("installed_reference_test")
    assert kernels.kernels_under_test() == ("decomposed", "flex", "block_padded")
