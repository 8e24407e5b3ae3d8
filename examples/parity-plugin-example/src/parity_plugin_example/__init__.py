"""An out-of-tree fastpath-parity plugin: what a team adds to judge its own model family and kernel.

The suite finds ``register`` through the ``fastpath_parity.plugins`` entry point of this package's
pyproject, so installing the package is the whole integration: no file of the suite is edited.
"""

from __future__ import annotations

from types import ModuleType

from parity_plugin_example import lumina2, pixart, zimage
from parity_plugin_example.kernels import row_chunked

__all__ = ["register"]

ORIGIN = "parity-plugin-example"


def register(plugins: ModuleType) -> None:
    """Add the PixArt, Lumina2 and Z-Image replay families, their checkpoint kinds and the row-chunked kernel
    (idempotent)."""
    for family in (pixart.FAMILY, lumina2.FAMILY, zimage.FAMILY):
        plugins.REPLAY_FAMILIES.register(family.name, family, origin=ORIGIN)
        plugins.CHECKPOINT_KINDS.register(family.checkpoint_kind.name, family.checkpoint_kind, origin=ORIGIN)
    plugins.ATTENTION_KERNELS.register("row_chunked_example", row_chunked, origin=ORIGIN)
