"""The VAE the decode path ships, registered through the suite's plugin door (entry point ``decode``).

A VAE entry names the diffusers class it drives and the stock and sharded calls of the path, so the
gpu tier can go from a checkpoint's ``_class_name`` to the functions it judges; the checkpoint kind
says that such a directory feeds the decode path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness.decode import sharded
from harness.plugins.entry_points import CheckpointKind

__all__ = ["MINIMAX_H3", "MINIMAX_H3_KIND", "VaeFamily", "register"]


@dataclass(frozen=True)
class VaeFamily:
    """A video VAE the decode path can shard: its diffusers class and the calls under test.

    An installed VAE that gives ``tiny`` (a factory of a seeded random-init VAE from a config) gets the
    decode catalogue's W x length matrix on it (``decode.<name>.t<frames>.w<W>.bitexact``); the suite's
    own VAE keeps its tiny models in ``fixtures.decode_models``."""

    name: str
    class_name: str
    stock_decode: Callable[..., Any]
    sharded_decode: Callable[..., Any]  # sharded_decode(vae, z, group), the conformance signature
    stock_encode: Callable[..., Any]
    sharded_encode: Callable[..., Any]
    tiny: Callable[[], Any] | None = None  # a seeded tiny VAE from a config: an installed VAE's CPU catalogue

    def drives(self, vae: Any) -> bool:
        return type(vae).__name__ == self.class_name


MINIMAX_H3 = VaeFamily("minimax_h3", "AutoencoderKLMiniMaxH3", sharded.stock_decode, sharded.sharded_decode,
                       sharded.stock_encode, sharded.sharded_encode)

MINIMAX_H3_KIND = CheckpointKind(name="video_vae", feeds="decode", class_names=(MINIMAX_H3.class_name,),
                                 source="diffusers", family=MINIMAX_H3.name)


def register(plugins: Any) -> None:
    """Entry point of group ``fastpath_parity.plugins``: the MiniMax-H3 VAE and its checkpoint kind."""
    origin = "fastpath-parity (harness.decode.families)"
    plugins.VAES.register(MINIMAX_H3.name, MINIMAX_H3, origin=origin)
    plugins.CHECKPOINT_KINDS.register(MINIMAX_H3_KIND.name, MINIMAX_H3_KIND, origin=origin)
