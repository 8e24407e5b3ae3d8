"""The replay families the suite ships, and lookups over every registered family (plugins included).

A family is an adapter (CFG layout and combine), the checkpoint kind it drives and the diffusers
pipeline it is tied to (the pipeline oracle runs it under the scheduler named here). The suite's
own register through the same door as an installed package's: ``register(plugins)``, named by the
``replay`` entry point of the ``fastpath_parity.plugins`` group. Lookups register the shipped
families first (idempotent), so a source checkout whose installed metadata predates the entry point
still knows them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from fnmatch import fnmatchcase
from types import ModuleType

from harness.plugins import entry_points as plugins
from harness.plugins.entry_points import CheckpointKind
from harness.replay.families.base import ModelAdapter, PipelineSpec, ReplayFamily
from harness.replay.families.cogview4 import CogView4Adapter
from harness.replay.families.flux import FluxAdapter
from harness.replay.families.hunyuan_image3 import HunyuanImage3Adapter
from harness.replay.families.qwen_image import QwenImageAdapter
from harness.replay.families.sana import SanaAdapter
from harness.replay.families.sd3 import SD3Adapter

__all__ = [
    "COGVIEW4",
    "FLUX",
    "HUNYUAN_IMAGE3",
    "QWEN_IMAGE",
    "REMOTE_CODE",
    "SANA",
    "SD3",
    "SHIPPED",
    "ModelAdapter",
    "PipelineSpec",
    "ReplayFamily",
    "family_for_class",
    "get_family",
    "register",
    "registered_families",
]

ORIGIN = "harness.replay.families"


def _kind(name: str, class_name: str, family: str) -> CheckpointKind:
    return CheckpointKind(name, feeds="replay", class_names=(class_name,), source="diffusers", family=family)


def flow_match_scheduler(**config: float | str | bool) -> object:
    """The flow-matching Euler scheduler with ``config`` (the pipeline derives t = 1000 sigma)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**config)


def _flow_match(**config: float | str | bool) -> Callable[[], object]:
    """A factory of that scheduler: a partial of a module-level function, no closure, so what the factory builds
    is always what ``flow_match_scheduler`` says now."""
    return functools.partial(flow_match_scheduler, **config)


DYNAMIC_SHIFT = {"use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15}  # mu from the image size
SD3 = ReplayFamily("sd3", SD3Adapter, _kind("sd3_transformer", "SD3Transformer2DModel", "sd3"),
                   PipelineSpec("StableDiffusion3Pipeline", _flow_match(shift=3.0)))
FLUX = ReplayFamily("flux", FluxAdapter, _kind("flux_transformer", "FluxTransformer2DModel", "flux"),
                    PipelineSpec("FluxPipeline", _flow_match(**DYNAMIC_SHIFT), guidance_kwarg="true_cfg_scale"))
QWEN_IMAGE = ReplayFamily("qwen_image", QwenImageAdapter,
                          _kind("qwen_image_transformer", "QwenImageTransformer2DModel", "qwen_image"),
                          PipelineSpec("QwenImagePipeline", _flow_match(**DYNAMIC_SHIFT),
                                       guidance_kwarg="true_cfg_scale"))
# CogView4's scheduler config: a linear, resolution-dependent time shift on sigmas, timesteps left unshifted
COGVIEW4 = ReplayFamily("cogview4", CogView4Adapter, _kind("cogview4_transformer", "CogView4Transformer2DModel",
                                                           "cogview4"),
                        PipelineSpec("CogView4Pipeline", _flow_match(
                            base_image_seq_len=256, base_shift=0.25, max_image_seq_len=4096, max_shift=0.75,
                            shift=1.0, time_shift_type="linear", use_dynamic_shifting=True)))
SANA = ReplayFamily("sana", SanaAdapter, _kind("sana_transformer", "SanaTransformer2DModel", "sana"),
                    PipelineSpec("SanaPipeline", _flow_match(shift=3.0),
                                 call_kwargs={"negative_prompt": None, "use_resolution_binning": False}))
SHIPPED = (SD3, FLUX, QWEN_IMAGE, COGVIEW4, SANA)
# HunyuanImage-3's image forward lives on its causal MM model, whose checkpoints the ar path's kind
# ``hunyuan_image3`` already recognises (harness.inputs.checkpoints): the family's own kind is never registered for
# detection (two kinds may not claim one class), the gpu tier drives replay from that checkpoint kind.


def model_own_scheduler() -> None:
    """HunyuanImage-3's loop builds its scheduler itself, from the model's generation config: nothing to supply."""
    return None


HUNYUAN_IMAGE3 = ReplayFamily("hunyuan_image3", HunyuanImage3Adapter,
                              CheckpointKind("hunyuan_image3_replay", feeds="replay",
                                             class_names=("HunyuanImage3ForCausalMM",), source="remote_code",
                                             family="hunyuan_image3"),
                              PipelineSpec("HunyuanImage3Text2ImagePipeline", model_own_scheduler,
                                           prompt_arg="input_ids", oracle="harness.replay.hunyuan_oracle:ORACLE"))
REMOTE_CODE = (HUNYUAN_IMAGE3,)


def register(registry: ModuleType) -> None:
    """Entry point ``replay``: the shipped families and their checkpoint kinds (idempotent: the same objects); the
    remote-code families without theirs (see ``HUNYUAN_IMAGE3``)."""
    for family in SHIPPED:
        registry.REPLAY_FAMILIES.register(family.name, family, origin=ORIGIN)
        registry.CHECKPOINT_KINDS.register(family.checkpoint_kind.name, family.checkpoint_kind, origin=ORIGIN)
    for family in REMOTE_CODE:
        registry.REPLAY_FAMILIES.register(family.name, family, origin=ORIGIN)


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
    """The family whose registered replay checkpoint kind answers to ``class_name`` (a model's class), or the
    remote-code family whose own kind does (its checkpoints are detected as another path's kind)."""
    register(plugins)
    matches = sorted({kind.family for _, kind in plugins.CHECKPOINT_KINDS.items()
                      if kind.feeds == "replay" and kind.family
                      and any(fnmatchcase(class_name, pattern) for pattern in kind.class_names)}
                     | {family.name for family in REMOTE_CODE
                        if any(fnmatchcase(class_name, pattern) for pattern in family.class_names)})
    if not matches:
        raise LookupError(f"no registered replay family drives {class_name}; registered replay families: "
                          f"{_listing()}. Add one by registering a ReplayFamily and its CheckpointKind from a "
                          f"{plugins.ENTRY_POINT_GROUP!r} entry point")
    if len(matches) > 1:
        claims = "; ".join(f"{kind.name} (family {kind.family}, {plugins.CHECKPOINT_KINDS.origin(kind.name) or '?'})"
                           for _, kind in plugins.CHECKPOINT_KINDS.items()
                           if kind.feeds == "replay" and kind.family in matches
                           and any(fnmatchcase(class_name, p) for p in kind.class_names))
        raise LookupError(f"replay families {matches} all claim {class_name} through their checkpoint kinds: "
                          f"{claims}. A model class picks one family: uninstall one of these packages or narrow "
                          "its kind's class_names")
    return get_family(matches[0])
