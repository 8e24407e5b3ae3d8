"""Flux and Qwen-Image's 2 x 2 latent packing, held to FluxPipeline's own pack and unpack."""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxPipeline

from harness.replay.families.packing import pack_latents, unpack_latents

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize(("h", "w"), [(4, 6), (8, 2)])
def test_packing_is_the_pipelines_own_and_unpacking_inverts_it(h, w):
    latents = torch.randn(2, 3, h, w, generator=torch.Generator().manual_seed(0))
    packed = pack_latents(latents)
    assert torch.equal(packed, FluxPipeline._pack_latents(latents, 2, 3, h, w))
    assert torch.equal(unpack_latents(packed, (3, h, w)), latents)
    assert torch.equal(unpack_latents(packed, (3, h, w)), FluxPipeline._unpack_latents(packed, 8 * h, 8 * w, 8))


def test_odd_sides_and_tokens_of_another_shape_are_refused():
    with pytest.raises(ValueError, match="needs even H and W, got H=4, W=5"):
        pack_latents(torch.zeros(1, 3, 4, 5))
    with pytest.raises(ValueError, match="needs even H and W, got H=3, W=4"):
        unpack_latents(torch.zeros(1, 2, 12), (3, 3, 4))
    with pytest.raises(ValueError, match=r"packed tokens have shape \(1, 6, 12\); latents \(3, 4, 4\) pack to "
                                         r"\(1, 4, 12\)"):
        unpack_latents(torch.zeros(1, 6, 12), (3, 4, 4))
