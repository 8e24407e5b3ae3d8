"""An out-of-tree fastpath-parity plugin: what a team adds to judge its own model family and kernel.

The suite finds ``register`` through the ``fastpath_parity.plugins`` entry point of this package's
pyproject, so installing the package is the whole integration: no file of the suite is edited.
"""

from __future__ import annotations

from types import ModuleType

from parity_plugin_example.kernels import row_chunked
from parity_plugin_example.pixart import CHECKPOINT_KIND, FAMILY

__all__ = ["register"]

ORIGIN = "parity-plugin-example"


def register(plugins: ModuleType) -> None:
    """Add the PixArt replay family, its checkpoint kind and the row-chunked kernel (idempotent)."""
    plugins.REPLAY_FAMILIES.register(FAMILY.name, FAMILY, origin=ORIGIN)
    plugins.CHECKPOINT_KINDS.register(CHECKPOINT_KIND.name, CHECKPOINT_KIND, origin=ORIGIN)
    plugins.ATTENTION_KERNELS.register("row_chunked_example", row_chunked, origin=ORIGIN)
