"""The replay families the suite ships, and lookups over every registered family (plugins included).

A family is an adapter (CFG layout and combine) plus the checkpoint kind it drives. The suite's
own register through the same door as an installed package's: ``register(plugins)``, named by the
``replay`` entry point of the ``fastpath_parity.plugins`` group. Lookups register the shipped
families first (idempotent), so a source checkout whose installed metadata predates the entry point
still knows them.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from types import ModuleType

from harness import plugins
from harness.plugins import CheckpointKind
from harness.replay.families.base import ModelAdapter, ReplayFamily
from harness.replay.families.flux import FluxAdapter
from harness.replay.families.qwen_image import QwenImageAdapter
from harness.replay.families.sd3 import SD3Adapter

__all__ = [
    "FLUX",
    "QWEN_IMAGE",
    "SD3",
    "SHIPPED",
    "ModelAdapter",
    "ReplayFamily",
    "family_for_class",
    "get_family",
    "register",
    "registered_families",
]

ORIGIN = "harness.replay.families"


def _kind(name: str, class_name: str, family: str) -> CheckpointKind:
    return CheckpointKind(name, feeds="replay", class_names=(class_name,), source="diffusers", family=family)


SD3 = ReplayFamily("sd3", SD3Adapter, _kind("sd3_transformer", "SD3Transformer2DModel", "sd3"))
FLUX = ReplayFamily("flux", FluxAdapter, _kind("flux_transformer", "FluxTransformer2DModel", "flux"))
QWEN_IMAGE = ReplayFamily("qwen_image", QwenImageAdapter,
                          _kind("qwen_image_transformer", "QwenImageTransformer2DModel", "qwen_image"))
SHIPPED = (SD3, FLUX, QWEN_IMAGE)


def register(registry: ModuleType) -> None:
    """Entry point ``replay``: the shipped families and their checkpoint kinds (idempotent: the same objects)."""
    for family in SHIPPED:
        registry.REPLAY_FAMILIES.register(family.name, family, origin=ORIGIN)
        registry.CHECKPOINT_KINDS.register(family.checkpoint_kind.name, family.checkpoint_kind, origin=ORIGIN)


def registered_families() -> list[ReplayFamily]:
    """Every registered replay family, in name order."""
    register(plugins)
    return [family for _, family in plugins.REPLAY_FAMILIES.items()]


def _listing() -> str:
    return ", ".join(f"{f.name} ({'/'.join(f.class_names)})" for f in registered_families()) or "none"


def get_family(name: str) -> ReplayFamily:
    """The registered family ``name``; an unknown name is a KeyError listing the registered ones."""
    register(plugins)
    return plugins.REPLAY_FAMILIES.get(name)


def family_for_class(class_name: str) -> ReplayFamily:
    """The family whose registered replay checkpoint kind answers to ``class_name`` (a model's class)."""
    register(plugins)
    matches = sorted({kind.family for _, kind in plugins.CHECKPOINT_KINDS.items()
                      if kind.feeds == "replay" and kind.family
                      and any(fnmatchcase(class_name, pattern) for pattern in kind.class_names)})
    if len(matches) != 1:
        what = "no registered replay family drives" if not matches else f"families {matches} all claim"
        raise LookupError(f"{what} {class_name}; registered replay families: {_listing()}. Add one by "
                          "registering a ReplayFamily and its CheckpointKind from a "
                          f"{plugins.ENTRY_POINT_GROUP!r} entry point")
    return get_family(matches[0])
