"""What kind of checkpoint a path holds, read from its files, and how to load it offline.

The gpu tier runs the checks of the path a checkpoint feeds: a diffusers video VAE feeds decode,
a diffusers DiT feeds replay, a causal LM (transformers, or HunyuanImage-3 remote code) feeds ar,
a directory of attention captures feeds attention. Anything else is a clear error naming the path
and what was expected, never a silently skipped tier.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness import device_map as device_maps

__all__ = ["KINDS", "Checkpoint", "CheckpointError", "detect", "load_model"]

VIDEO_VAE_CLASSES = ("AutoencoderKLMiniMaxH3",)
DIT_CLASSES = ("SD3Transformer2DModel", "FluxTransformer2DModel")
REMOTE_CODE_ARCHITECTURES = ("HunyuanImage3ForCausalMM",)
CAPTURE_GLOB = "call*_rank*.npz"

# kind -> the path whose checks it feeds
KINDS = {"video_vae": "decode", "dit": "replay", "causal_lm": "ar", "attention_capture": "attention"}

EXPECTED = (
    "a diffusers model directory whose config.json has _class_name in "
    f"{list(VIDEO_VAE_CLASSES + DIT_CLASSES)}, a transformers directory whose config.json lists a "
    f"*ForCausalLM (or {list(REMOTE_CODE_ARCHITECTURES)}) in architectures, or a directory of attention "
    f"captures named {CAPTURE_GLOB}"
)


class CheckpointError(ValueError):
    """The path is missing, is not a model of a known kind, or cannot be loaded."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    kind: str  # a key of KINDS
    class_name: str
    config: dict[str, Any] = field(default_factory=dict, compare=False)
    remote_code: bool = False

    @property
    def feeds(self) -> str:
        return KINDS[self.kind]

    @property
    def name(self) -> str:
        return self.path.name


def _read_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"checkpoint {path}: config.json is not valid JSON ({err})") from err


def detect(path: str | Path) -> Checkpoint:
    """Read a checkpoint's kind from its files (config.json or capture names); nothing is loaded."""
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"checkpoint {root}: no such file or directory")
    if not root.is_dir():
        raise CheckpointError(f"checkpoint {root}: expected a directory, got a file; expected {EXPECTED}")
    if (root / "model_index.json").exists() and not (root / "config.json").exists():
        raise CheckpointError(f"checkpoint {root}: this is a diffusers pipeline directory; pass the component "
                              f"directory instead (e.g. {root / 'vae'} or {root / 'transformer'})")
    if (root / "config.json").exists():
        config = _read_config(root)
        class_name = config.get("_class_name")
        if class_name in VIDEO_VAE_CLASSES:
            return Checkpoint(root, "video_vae", class_name, config)
        if class_name in DIT_CLASSES:
            return Checkpoint(root, "dit", class_name, config)
        architectures = config.get("architectures") or []
        for arch in architectures:
            if arch in REMOTE_CODE_ARCHITECTURES:
                if "auto_map" not in config:
                    raise CheckpointError(f"checkpoint {root}: {arch} needs its remote code, but config.json has "
                                          "no auto_map pointing at the modeling files in the directory")
                return Checkpoint(root, "causal_lm", arch, config, remote_code=True)
            if arch.endswith("ForCausalLM"):
                return Checkpoint(root, "causal_lm", arch, config)
        found = class_name or (architectures and architectures[0]) or "neither _class_name nor architectures"
        raise CheckpointError(f"checkpoint {root}: unsupported model kind ({found}); expected {EXPECTED}")
    if any(root.glob(CAPTURE_GLOB)):
        return Checkpoint(root, "attention_capture", "capture")
    raise CheckpointError(f"checkpoint {root}: not a model (no config.json, no {CAPTURE_GLOB}); expected {EXPECTED}")


def load_model(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device | str,
               device_map: str | device_maps.DeviceMap | None = None) -> Any:
    """Load a model checkpoint offline in ``dtype`` on ``device``; failures name the path.

    ``device_map`` (text or DeviceMap; default: the run's --device-map, else one device where the weights
    fit) places the model through accelerate instead (harness.device_map).
    """
    placement = device_maps.resolve(checkpoint.path, dtype, device, device_map)
    placing = placement.loader_kwargs() if placement is not None else {}
    try:
        if checkpoint.kind in ("video_vae", "dit"):
            import diffusers

            cls = getattr(diffusers, checkpoint.class_name)
            model = cls.from_pretrained(checkpoint.path, torch_dtype=dtype, local_files_only=True, **placing)
        elif checkpoint.kind == "causal_lm":
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(
                checkpoint.path, dtype=dtype, local_files_only=True, trust_remote_code=checkpoint.remote_code,
                **placing)
        else:
            raise CheckpointError(f"checkpoint {checkpoint.path}: a {checkpoint.kind} holds no model to load")
    except CheckpointError:
        raise
    except Exception as err:  # any loader failure becomes one clear error naming the path
        mapped = f" with device map {placement.text!r}" if placement is not None else ""
        raise CheckpointError(f"checkpoint {checkpoint.path}: could not load {checkpoint.class_name}{mapped} "
                              f"({type(err).__name__}: {err})") from err
    if placement is not None:
        device_maps.record(str(checkpoint.path), placement, model)
        return model.eval()  # accelerate placed (and hooked) it: moving it again would undo the split
    return model.to(device).eval()
