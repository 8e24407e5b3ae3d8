"""What kind of checkpoint a path holds, read from its files, and how to load it offline.

The kinds are registrations, not a list here: ``harness.plugins.entry_points.CHECKPOINT_KINDS`` holds one
``CheckpointKind`` per kind (the suite's own through ``register`` below, an installed package's
through the same entry-point group), each naming the path it feeds, the class names it answers to
and where those names are read (``SOURCES``). Anything no registered kind recognises is a clear
error listing what is supported, never a silently skipped tier.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import os
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from harness.inputs import device_map as device_maps
from harness.paths import PATHS
from harness.plugins import entry_points as plugins
from harness.plugins.entry_points import CheckpointKind
from harness.process import progress_lines

__all__ = ["KINDS", "SHIPPED_KINDS", "SOURCES", "TRUST_FLAG", "Checkpoint", "CheckpointError", "detect",
           "kind_for_family", "load_model", "not_a_file", "null_fields", "refuse_null_fields", "register",
           "registered_kinds", "remote_code_ran", "require_trust", "supported", "trust_remote_code", "trusted"]

CAPTURE_GLOB = "call*_rank*.npz"
FEEDS = PATHS  # a checkpoint feeds one of the paths
CONFIG_MAX_BYTES = 16 * 2**20  # real configs are kilobytes; anything this large is not one

# The opt-in a run needs before any Python file shipped in a checkpoint directory is imported (transformers'
# own name for it): a parity suite is pointed at directories from many sources, so it is off by default.
TRUST_FLAG = "--trust-remote-code"

# source -> where a kind's class_names are matched (fnmatch patterns, so "*ForCausalLM" is one kind)
SOURCES = {
    "diffusers": "config.json's _class_name",
    "transformers": "config.json's architectures (loaded as remote code when config.json has an auto_map)",
    "remote_code": "config.json's architectures; the modeling code ships in the directory (auto_map required)",
    "files": "file names in the directory (e.g. attention captures)",
}

# The suite's own kinds. A path that registers its kinds itself (its own register(plugins)) takes its
# entry out of this tuple: two kinds claiming one class name are an error at detection.
SHIPPED_KINDS = (
    CheckpointKind("causal_lm", "ar", ("*ForCausalLM",), "transformers"),
    # its own kind: it claims more gpu kill items than a plain causal LM (gpu/ar.py KIND_KILLS)
    CheckpointKind("hunyuan_image3", "ar", ("HunyuanImage3ForCausalMM",), "remote_code",
                   family="hunyuan_image3_remote_code"),
    CheckpointKind("attention_capture", "attention", (CAPTURE_GLOB,), "files"),
)


def register(registry: ModuleType) -> None:
    """Entry point ``checkpoints``: the suite's own checkpoint kinds (idempotent: the same objects)."""
    for kind in SHIPPED_KINDS:
        registry.CHECKPOINT_KINDS.register(kind.name, kind, origin="harness.inputs.checkpoints")


class CheckpointError(ValueError):
    """The path is missing, is not a model of a registered kind, or cannot be loaded."""


def _validate(kind: Any, origin: str) -> CheckpointKind:
    where = f"checkpoint kind {getattr(kind, 'name', kind)!r} (registered by {origin or 'unknown origin'})"
    if not isinstance(kind, CheckpointKind):
        raise CheckpointError(f"{where}: expected a harness.plugins.entry_points.CheckpointKind, "
                              f"got {type(kind).__name__}")
    if kind.feeds not in FEEDS:
        raise CheckpointError(f"{where}: feeds must be one of {list(FEEDS)}, got {kind.feeds!r}")
    if kind.source not in SOURCES:
        raise CheckpointError(f"{where}: source must be one of {sorted(SOURCES)}, got {kind.source!r}")
    names = kind.class_names
    if not isinstance(names, tuple) or not names or not all(isinstance(n, str) and n for n in names):
        raise CheckpointError(f"{where}: class_names must be a non-empty tuple of strings, got {names!r}")
    return kind


# The suite's own plugins that register kinds of their own (pyproject's entry points, mirrored here).
SUITE_KIND_PLUGINS = ("harness.decode.families", "harness.replay.families")


def registered_kinds() -> list[CheckpointKind]:
    """Every registered kind, validated, in name order (plugins loaded first).

    The suite's own kinds are registered here too (idempotent), so a source checkout on PYTHONPATH
    whose installed metadata predates the suite's entry points still knows them.
    """
    register(plugins)
    for module in SUITE_KIND_PLUGINS:
        importlib.import_module(module).register(plugins)
    return [_validate(kind, plugins.CHECKPOINT_KINDS.origin(name)) for name, kind in plugins.CHECKPOINT_KINDS.items()]


def _describe(kind: CheckpointKind) -> str:
    family = f", family {kind.family}" if kind.family else ""
    return f"{kind.name} (feeds {kind.feeds}{family}: {kind.source} {', '.join(kind.class_names)})"


def supported() -> str:
    """The registered kinds in one line, for error messages."""
    kinds = registered_kinds()
    listed = "; ".join(_describe(k) for k in kinds) or "none"
    return (f"registered checkpoint kinds: {listed}. A package adds one by registering a "
            f"harness.plugins.entry_points.CheckpointKind in CHECKPOINT_KINDS from its "
            f"{plugins.ENTRY_POINT_GROUP!r} entry point")


class _Kinds(Mapping[str, str]):
    """``KINDS[kind name] -> the path it feeds``, read from the registry each time (plugins included)."""

    def _now(self) -> dict[str, str]:
        return {kind.name: kind.feeds for kind in registered_kinds()}

    def __getitem__(self, name: str) -> str:
        return self._now()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._now())

    def __len__(self) -> int:
        return len(self._now())

    def __repr__(self) -> str:
        return repr(self._now())


KINDS: Mapping[str, str] = _Kinds()


def kind_for_family(feeds: str, family: str) -> CheckpointKind:
    """The registered kind whose checkpoints drive ``family`` of path ``feeds``; none is an error listing them."""
    found = [k for k in registered_kinds() if k.feeds == feeds and k.family == family]
    if len(found) != 1:
        what = "no checkpoint kind" if not found else f"{len(found)} checkpoint kinds ({[k.name for k in found]})"
        raise CheckpointError(f"{feeds} family {family!r}: {what} the gpu tier recognises registers it "
                              f"(CheckpointKind(..., feeds={feeds!r}, family={family!r})); {supported()}")
    return found[0]


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    kind: str  # a registered CheckpointKind's name
    class_name: str
    config: dict[str, Any] = field(default_factory=dict, compare=False)
    remote_code: bool = False
    spec: CheckpointKind | None = field(default=None, compare=False)

    @property
    def feeds(self) -> str:
        return self.spec.feeds if self.spec is not None else KINDS[self.kind]

    @property
    def family(self) -> str:
        """The registry entry of the fed path that drives it ("" when the path has one way to drive it)."""
        return self.spec.family if self.spec is not None else ""

    @property
    def source(self) -> str:
        return self.spec.source if self.spec is not None else ""

    @property
    def name(self) -> str:
        return self.path.name


def _read_config(path: Path) -> dict[str, Any]:
    """config.json as a JSON object; any other content (a directory, binary, a list, null) is a CheckpointError.

    The file is untrusted data: whatever it holds, the answer is a dict or an error naming the file.
    """
    config_file = path / "config.json"
    where = f"checkpoint {path}: config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{where} is not a regular file (a model directory holds its config as a JSON file)")
    try:
        size = config_file.stat().st_size
        if size > CONFIG_MAX_BYTES:
            raise CheckpointError(f"{where} is {size} bytes; a model config is a small JSON object (at most "
                                  f"{CONFIG_MAX_BYTES} bytes read)")
        raw = config_file.read_bytes()
    except OSError as err:
        raise CheckpointError(f"{where} cannot be read ({type(err).__name__}: {err.strerror or err})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{where} is not UTF-8 text (byte {err.start}: {raw[err.start:err.start + 1]!r}); "
                              "expected a JSON object") from None
    try:
        config = json.loads(text)
    except (json.JSONDecodeError, RecursionError, ValueError) as err:
        shown = f"{err.msg}: line {err.lineno}, column {err.colno}" if isinstance(err, json.JSONDecodeError) \
            else f"{type(err).__name__}: {str(err)[:120]}"
        raise CheckpointError(f"{where} is not valid JSON ({shown}); expected a JSON object") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{where} holds a JSON {_json_type(config)}, expected a JSON object "
                              '(e.g. {"architectures": [...]} or {"_class_name": ...})')
    for key, expected, ok in (("_class_name", "a string", lambda v: isinstance(v, str)),
                              ("architectures", "a list of strings",
                               lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v)),
                              ("auto_map", "an object", lambda v: isinstance(v, dict))):
        if config.get(key) is not None and not ok(config[key]):  # null reads as absent, as transformers reads it
            raise CheckpointError(f"{where}: {key} must be {expected}, got a JSON {_json_type(config[key])}")
    bad = _first_non_finite(config)
    if bad is not None:  # Python's json reads NaN and Infinity, which no model config means
        field_name, value = bad
        raise CheckpointError(f"{where}: field {field_name} is {value}; a model config holds finite numbers")
    return config


def _first_non_finite(value: Any, where: str = "") -> tuple[str, float] | None:
    """The first NaN or infinite number in a parsed JSON value, with its field path ('a.b[2]'), or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(where), value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        found = _first_non_finite(inner, f"{where}[{key}]" if isinstance(key, int) else
                                  f"{where}.{key}" if where else str(key))
        if found is not None:
            return found
    return None


def null_fields(checkpoint: Checkpoint) -> list[str]:
    """config.json fields that are null where the diffusers model being loaded takes a value: diffusers hands
    config fields to the constructor as they are, so the loader would fail deep inside the model's code, naming
    nothing. A null is the model's own when its parameter defaults to None or is annotated to admit None
    (``out_channels: int | None = 16`` reads null as "same as in_channels"). A transformers config is left to its
    config class, which reads many nulls as "unset" by design even where its default is a value (Mistral's
    ``sliding_window``), and remote code is never imported to read its defaults."""
    if checkpoint.source != "diffusers" or None not in checkpoint.config.values():
        return []  # diffusers is imported only for a config that holds a null
    import diffusers

    cls = getattr(diffusers, checkpoint.class_name, None)
    if cls is None:
        return []
    try:
        parameters = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return []
    return [name for name, value in checkpoint.config.items()
            if value is None and name in parameters and _takes_a_value(parameters[name])]


def _takes_a_value(parameter: inspect.Parameter) -> bool:
    """Whether a constructor parameter cannot be None: its default is a value (or it has none) and its annotation,
    when it has one, does not admit None. An unannotated parameter without a default says nothing either way."""
    empty = inspect.Parameter.empty
    if parameter.default is None or (parameter.default is empty and parameter.annotation is empty):
        return False
    return not _admits_none(parameter.annotation)


def _admits_none(annotation: Any) -> bool:
    if annotation is inspect.Parameter.empty:
        return False
    if isinstance(annotation, str):  # a module with postponed annotations: read the text, never evaluate it
        return "None" in annotation or "Optional" in annotation or annotation in ("Any", "typing.Any")
    if annotation is Any or annotation is None or annotation is type(None):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # Optional[X], X | None
        return any(_admits_none(arg) for arg in typing.get_args(annotation))
    return False


def refuse_null_fields(checkpoint: Checkpoint) -> None:
    """A CheckpointError naming the config.json fields ``null_fields`` finds, before anything loads."""
    nulls = null_fields(checkpoint)
    if nulls:
        fields = f"field {nulls[0]!r} is" if len(nulls) == 1 else f"fields {', '.join(map(repr, nulls))} are"
        admits = "its parameter does" if len(nulls) == 1 else "those parameters do"
        raise CheckpointError(f"checkpoint {checkpoint.path}: config.json {fields} null where "
                              f"{checkpoint.class_name} takes a value ({admits} not default to or admit None)")


def _json_type(value: Any) -> str:
    """JSON's name for a decoded value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def _candidates(kind: CheckpointKind, root: Path, config: dict[str, Any] | None) -> list[str]:
    """The names a kind's class_names are matched against, read from where its source says."""
    if kind.source == "files":
        return sorted(p.name for p in root.iterdir())
    if config is None:
        return []
    if kind.source == "diffusers":
        name = config.get("_class_name")
        return [name] if isinstance(name, str) else []
    return list(config.get("architectures") or [])


def _match(kind: CheckpointKind, names: list[str]) -> str | None:
    for name in names:
        if any(fnmatchcase(name, pattern) for pattern in kind.class_names):
            return name
    return None


def detect(path: str | Path) -> Checkpoint:
    """Read a checkpoint's kind from its files against the registered kinds; nothing is loaded."""
    root = Path(path)
    if root.is_symlink() and not root.exists():
        raise CheckpointError(f"checkpoint {not_a_file(root, 'a model directory')}")
    if not root.exists():
        raise CheckpointError(f"checkpoint {root}: no such file or directory")
    if not root.is_dir():
        raise CheckpointError(f"checkpoint {root}: expected a directory, got a file; {supported()}")
    if not os.access(root, os.R_OK | os.X_OK):
        raise CheckpointError(f"checkpoint {root}: the directory cannot be listed (permission denied)")
    if (root / "model_index.json").exists() and not (root / "config.json").exists():
        raise CheckpointError(f"checkpoint {root}: this is a diffusers pipeline directory; pass the component "
                              f"directory instead (e.g. {root / 'vae'} or {root / 'transformer'})")
    config = _read_config(root) if (root / "config.json").exists() else None
    kinds = registered_kinds()
    if config is not None:  # a model directory is read from its config, never from stray files beside it
        kinds = [k for k in kinds if k.source != "files"] or kinds
    matches = [(k, name) for k in kinds if (name := _match(k, _candidates(k, root, config))) is not None]
    if len(matches) > 1:
        claims = ", ".join(f"{k.name} ({plugins.CHECKPOINT_KINDS.origin(k.name) or 'unknown origin'})"
                           for k, _ in matches)
        raise CheckpointError(f"checkpoint {root}: {matches[0][1]} is claimed by several checkpoint kinds: {claims}; "
                              "exactly one registered kind may claim a class name")
    if not matches:
        if config is None:
            raise CheckpointError(f"checkpoint {root}: not a model (no config.json, and no registered kind's files); "
                                  f"{supported()}")
        architectures = config.get("architectures") or []
        found = config.get("_class_name") or (architectures[0] if architectures else "") or \
            "neither _class_name nor architectures"
        raise CheckpointError(f"checkpoint {root}: unsupported model kind ({found}); {supported()}")
    kind, class_name = matches[0]
    if kind.source == "files":
        return Checkpoint(root, kind.name, class_name, {}, spec=kind)
    remote = kind.source == "remote_code" or (kind.source == "transformers" and bool(config.get("auto_map")))
    if kind.source == "remote_code" and not config.get("auto_map"):
        raise CheckpointError(f"checkpoint {root}: {class_name} needs its remote code, but config.json has "
                              "no auto_map pointing at the modeling files in the directory")
    found = Checkpoint(root, kind.name, class_name, config, remote_code=remote, spec=kind)
    refuse_null_fields(found)
    return found


def not_a_file(path: Path, expected: str) -> str:
    """What ``path`` is, in words, when it is not the regular file (or directory) ``expected`` names: a symlink
    loop or a dangling link reads "does not exist" to ``Path.exists``, which names nothing a user can fix."""
    if path.is_symlink():
        try:
            path.resolve(strict=True)
        except RuntimeError:
            return f"{path} is a symlink loop; expected {expected}"
        except OSError:
            return f"{path} is a symlink to {os.readlink(path)}, which does not exist; expected {expected}"
    if path.is_dir():
        return f"{path} is a directory; expected {expected}"
    if path.is_file():
        return f"{path} is a file; expected {expected}"
    if path.exists():
        return f"{path} is not a regular file (a device, a socket or a pipe); expected {expected}"
    return f"{path} does not exist; expected {expected}"


_TRUSTED: list[bool] = [False]  # the run's --trust-remote-code (harness.plugin sets it; off by default)
_REMOTE_CODE_RAN: list[str] = []  # checkpoint directories whose own Python a load imported, in load order


def trust_remote_code(trusted: bool) -> None:
    """The run's opt-in: whether loads may import the Python files shipped in a checkpoint directory."""
    _TRUSTED[0] = bool(trusted)
    if not trusted:
        _REMOTE_CODE_RAN.clear()


def trusted() -> bool:
    return _TRUSTED[0]


def remote_code_ran() -> list[str]:
    """The checkpoint directories whose remote code this process loaded (the report records them)."""
    return list(dict.fromkeys(_REMOTE_CODE_RAN))


def require_trust(checkpoint: Checkpoint, trusted_here: bool | None = None) -> None:
    """Refuse a checkpoint whose loading would run its own Python unless the run opted in."""
    if not checkpoint.remote_code or (trusted() if trusted_here is None else trusted_here):
        return
    modules = sorted({str(v).split("--")[-1].rsplit(".", 1)[0] for v in _auto_map_targets(checkpoint.config)})
    shipped = f" ({', '.join(m + '.py' for m in modules)})" if modules else ""
    raise CheckpointError(f"checkpoint {checkpoint.path}: config.json has an auto_map, so loading "
                          f"{checkpoint.class_name} imports Python shipped in that directory{shipped}; that code is "
                          f"not run without {TRUST_FLAG} (off by default, as in transformers): pass {TRUST_FLAG} "
                          "if you trust this directory")


def _auto_map_targets(config: dict[str, Any]) -> list[str]:
    targets: list[str] = []
    for value in (config.get("auto_map") or {}).values():
        targets += [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)]
    return targets


def load_model(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device | str,
               device_map: str | device_maps.DeviceMap | None = None, *,
               trust_remote_code: bool | None = None) -> Any:
    """Load a model checkpoint offline in ``dtype`` on ``device``; failures name the path.

    ``device_map`` (text or DeviceMap; default: the run's --device-map, else one device where the weights
    fit) places the model through accelerate instead (harness.inputs.device_map). A checkpoint that ships its own
    modeling code loads only when ``trust_remote_code`` (default: the run's --trust-remote-code) allows it.
    """
    require_trust(checkpoint, trust_remote_code)
    refuse_null_fields(checkpoint)  # detect refused these already; a Checkpoint built by hand meets it here
    placement = device_maps.resolve(checkpoint.path, dtype, device, device_map)
    placing = placement.loader_kwargs() if placement is not None else {}
    with progress_lines.loading(str(checkpoint.path), str(dtype), f"{checkpoint.name} ({checkpoint.class_name}, "
                                f"{str(dtype).removeprefix('torch.')}) on {device}"):
        try:
            if checkpoint.source == "diffusers":
                import diffusers

                cls = getattr(diffusers, checkpoint.class_name)
                model = cls.from_pretrained(checkpoint.path, torch_dtype=dtype, local_files_only=True, **placing)
            elif checkpoint.source in ("transformers", "remote_code"):
                from transformers import AutoModelForCausalLM

                if checkpoint.remote_code:  # recorded before the import: code that ran in a failed load still ran
                    _REMOTE_CODE_RAN.append(str(checkpoint.path))
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
