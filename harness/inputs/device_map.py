"""Where a checkpoint's weights go: one device where they fit, else split over the visible GPUs by accelerate.

A real HunyuanImage-3 (~160 GB in bf16) does not fit one GPU; the seeds ran it with
``device_map="balanced"`` over eight. ``--device-map`` takes a strategy accelerate knows (balanced,
auto, sequential) or a JSON max-memory split (``'{"0": "70GiB", "1": "70GiB"}'``, keys are GPU
indices or "cpu"), and the loaders (diffusers and transformers ``from_pretrained``) place the model
through accelerate. Without the option a model stays on one device when its weights fit there.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["FIT_FRACTION", "STRATEGIES", "DeviceMap", "check_visible", "choose", "configure", "configured", "parse",
           "placements", "record", "resolve", "weight_bytes"]

STRATEGIES = ("balanced", "auto", "sequential")
# weights may take this share of one GPU's free memory before the default splits them: the rest holds
# activations, the KV cache and the checks' reference copies
FIT_FRACTION = 0.8
_MEMORY = re.compile(r"^\s*\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\s*$", re.IGNORECASE)
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
EXPECTED = (f"one of {', '.join(STRATEGIES)}, or a JSON max-memory split such as "
            '\'{"0": "70GiB", "1": "70GiB"}\' (keys: GPU index or "cpu"; values: "<number><unit>" or bytes)')


@dataclass(frozen=True)
class DeviceMap:
    """An accelerate placement: a strategy, optionally capped per device (``max_memory``)."""

    strategy: str
    max_memory: dict[int | str, int | str] | None = field(default=None, hash=False)
    text: str = ""  # as the user wrote it, for reports

    def loader_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for diffusers' and transformers' ``from_pretrained``."""
        kwargs: dict[str, Any] = {"device_map": self.strategy}
        if self.max_memory is not None:
            kwargs["max_memory"] = dict(self.max_memory)
        return kwargs


def parse(text: str) -> DeviceMap:
    """``--device-map`` text -> DeviceMap; anything else is a ValueError saying what is accepted."""
    if not isinstance(text, str):
        raise TypeError(f"--device-map must be a string, got {type(text).__name__}")
    given = text.strip()
    if given in STRATEGIES:
        return DeviceMap(given, None, given)
    if not given.startswith("{"):
        raise ValueError(f"--device-map {text!r}: expected {EXPECTED}")
    try:
        split = json.loads(given)
    except json.JSONDecodeError as err:
        raise ValueError(f"--device-map {text!r}: not valid JSON ({err}); expected {EXPECTED}") from None
    if not isinstance(split, dict) or not split:
        raise ValueError(f"--device-map {text!r}: a max-memory split must be a non-empty JSON object; "
                         f"expected {EXPECTED}")
    memory: dict[int | str, int | str] = {}
    for key, value in split.items():
        if key == "cpu":
            device: int | str = "cpu"
        elif key.isdigit():
            device = int(key)
        else:
            raise ValueError(f"--device-map {text!r}: device {key!r} is neither a GPU index nor \"cpu\"")
        positive_bytes = isinstance(value, int) and not isinstance(value, bool) and value > 0
        if not (positive_bytes or (isinstance(value, str) and _MEMORY.match(value))):
            raise ValueError(f"--device-map {text!r}: memory {value!r} for device {key!r} must be a positive "
                             "byte count or '<number><unit>' (B, KB, MB, GB, KiB, MiB, GiB, ...)")
        memory[device] = value.replace(" ", "") if isinstance(value, str) else value
    return DeviceMap("balanced", memory, given)


def weight_bytes(path: str | Path, dtype: torch.dtype) -> int | None:
    """The checkpoint's weights loaded in ``dtype``, in bytes (safetensors headers; file sizes otherwise)."""
    root = Path(path)
    total, found = 0, False
    itemsize = torch.empty((), dtype=dtype).element_size()
    for file in sorted(root.glob("*.safetensors")):
        found = True
        with file.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for size in entry["shape"]:
                numel *= size
            stored = entry["dtype"]
            floating = stored.startswith(("F", "BF"))
            total += numel * (itemsize if floating else _SAFETENSORS_BYTES.get(stored, 8))
    for file in sorted([*root.glob("*.bin"), *root.glob("*.pt")]):
        found = True
        total += file.stat().st_size
    return total if found else None


def _free_bytes() -> dict[int, int]:
    return {index: torch.cuda.mem_get_info(index)[0] for index in range(torch.cuda.device_count())}


def choose(requested: DeviceMap | None, device: torch.device, need: int | None,
           free: Mapping[int, int]) -> DeviceMap | None:
    """The placement to use: the requested one, else one device when ``need`` fits it, else balanced.

    ``free`` is the free memory per visible GPU; the default only splits a CUDA load that would not fit
    ``FIT_FRACTION`` of its device and has a second GPU to spill onto.
    """
    if requested is not None:
        return requested
    if device.type != "cuda" or need is None or len(free) < 2:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if need <= FIT_FRACTION * free.get(index, 0):
        return None
    return DeviceMap("balanced", None, f"balanced (default: {need / 2**30:.1f} GiB of weights exceed "
                                       f"{FIT_FRACTION:.0%} of GPU {index}'s free memory)")


_CONFIGURED: dict[str, DeviceMap] = {}  # device type -> the run's --device-map for loads on that device type
_PLACEMENTS: list[tuple[str, str, dict[str, str]]] = []  # (checkpoint, map text, module -> device) per load


def configure(requested: DeviceMap | None, device_type: str) -> None:
    """The run's --device-map for model loads on ``device_type`` (the gpu tier's device); None clears it.

    Loads on another device type (the decode check loads its VAE on the CPU, then every rank moves a
    whole copy to its own GPU) keep their single device.
    """
    _CONFIGURED.clear()
    if requested is not None:
        _CONFIGURED[device_type] = requested


def configured(device: torch.device | str) -> DeviceMap | None:
    return _CONFIGURED.get(torch.device(device).type)


def check_visible(spec: DeviceMap) -> None:
    """A max-memory split may only name GPUs this process sees (checked when the run starts, and per load)."""
    if spec.max_memory is None:
        return
    visible = torch.cuda.device_count()
    missing = sorted(k for k in spec.max_memory if isinstance(k, int) and k >= visible)
    if missing:
        raise ValueError(f"--device-map {spec.text}: GPUs {missing} are not visible ({visible} are)")


def resolve(path: str | Path, dtype: torch.dtype, device: torch.device | str,
            requested: str | DeviceMap | None) -> DeviceMap | None:
    """The placement for one load: ``requested`` (text or DeviceMap), else the run's, else one device if it fits."""
    device = torch.device(device)
    spec = parse(requested) if isinstance(requested, str) else requested
    spec = spec if spec is not None else configured(device)
    if spec is not None:
        check_visible(spec)
    if spec is None and device.type == "cuda" and torch.cuda.device_count() > 1:
        return choose(None, device, weight_bytes(path, dtype), _free_bytes())
    return spec


def record(checkpoint: str, spec: DeviceMap, model: Any) -> dict[str, str]:
    """Note where a device-mapped load put the model; returns module -> device.

    A split model carries accelerate's ``hf_device_map``; a map that resolved to one device leaves none
    (the loaders skip dispatch), so the parameters' devices are read instead. Devices outside a
    max-memory split are an error: the load did not honour it.
    """
    placed = {str(k): str(v) for k, v in (getattr(model, "hf_device_map", None) or {}).items()}
    if not placed:
        devices = sorted({str(p.device) for p in model.parameters()})
        placed = {"": devices[0]} if len(devices) == 1 else {f"<{d}>": d for d in devices}
    if spec.max_memory is not None:
        allowed = {"cpu" if k == "cpu" else str(k) for k in spec.max_memory}
        used = {_device_key(v) for v in placed.values()}
        if not used <= allowed:
            raise ValueError(f"checkpoint {checkpoint}: device map {spec.text!r} allows {sorted(allowed)} but the "
                             f"model was placed on {sorted(used)}")
    _PLACEMENTS.append((checkpoint, spec.text, placed))
    return placed


def _device_key(device: str) -> str:
    """'cuda:1' / '1' -> '1'; 'cpu' -> 'cpu' (max-memory keys)."""
    text = str(device)
    return text.removeprefix("cuda:") if text != "cuda" else str(torch.cuda.current_device())


def placements() -> list[tuple[str, str, dict[str, str]]]:
    """Every device-mapped load of this process: (checkpoint, map, module -> device)."""
    return list(_PLACEMENTS)
