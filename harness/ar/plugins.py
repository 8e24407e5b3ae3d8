"""The AR backends this suite ships, registered into ``harness.plugins.entry_points.AR_BACKENDS``.

``register`` is the ``register(plugins)`` an entry point of the ``fastpath_parity.plugins`` group names (the same
door an out-of-tree backend uses); the gpu tier also calls it directly, so the shipped backends are there even
when the project's own entry point is not installed. Registering twice is a no-op (same objects).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from harness.ar.backends import TransformersBackend, UpstreamBackend

__all__ = ["REMOTE_CODE", "SHIPPED", "TRANSFORMERS", "register"]

REMOTE_CODE = "hunyuan_image3_remote_code"  # both generations of HunyuanImage-3 remote code
TRANSFORMERS = "transformers_causal_lm"  # a transformers causal LM over transformers' own caches
SHIPPED: dict[str, Any] = {REMOTE_CODE: UpstreamBackend, TRANSFORMERS: TransformersBackend}


def register(plugins: ModuleType | None = None) -> None:
    """Add the shipped backends to ``plugins.AR_BACKENDS`` (default: ``harness.plugins.entry_points``)."""
    if plugins is None:
        import harness.plugins.entry_points as plugins
    for name, backend in SHIPPED.items():
        plugins.AR_BACKENDS.register(name, backend, origin="fastpath-parity (harness.ar.plugins)")
