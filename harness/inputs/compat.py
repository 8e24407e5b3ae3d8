"""Every transformers/diffusers version difference the suite meets, in one place, chosen once per major.

The supported range is transformers >=4.56,<6 (HunyuanImage-3's users run 4.56/4.57; its generation-1 remote
code imports modules 5.x removed). Each function here branches on ``TRANSFORMERS_MAJOR`` (never on a caught
exception), so ``tests/test_compat.py`` can assert which branch the installed stack takes.

Differences bridged:
- the config base class name (``PretrainedConfig`` on 4.x, ``PreTrainedConfig`` on 5.x);
- weight-init helpers: 5.x ``from_pretrained`` re-runs ``_init_weights`` over loaded weights and relies on
  ``transformers.initialization`` to skip them; 4.x only inits missing weights, with plain in-place ops;
- the name generation stores the cache under (``ALL_CACHE_NAMES[0]``: ``past_key_values`` / ``cache``) and the
  cache keyword a model's forward takes;
- ``StaticLayer.lazy_initialization`` arity (key only on 4.x, key and value on 5.x);
- removed modules (``transformers.modeling_attn_mask_utils`` is gone on 5.x);
- ``generate``'s mask rule (same on both: a passed mask must be 2-D, else the model's
  ``_prepare_attention_mask_for_generation`` builds it);
- diffusers classes that need a huggingface-hub transformers 4.x refuses (the MiniMax-H3 VAE).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable
from typing import Any

import torch
import transformers

__all__ = [
    "GENERATE_MASK_BUILDER",
    "REMOVED_IN_5",
    "TRANSFORMERS_MAJOR",
    "cache_kwarg_name",
    "config_base",
    "diffusers_has",
    "forward_cache_kwarg",
    "generate_accepts_mask",
    "has_module",
    "init_copy_",
    "init_normal_",
    "init_ones_",
    "init_zeros_",
    "lazy_init_arity",
    "lazy_init_layer",
    "path_unavailable",
    "remote_code_kwargs",
    "removed_module_reason",
    "takes_write_slots",
    "write_slot_kwargs",
]

TRANSFORMERS_MAJOR: int = int(transformers.__version__.split(".")[0])
if TRANSFORMERS_MAJOR not in (4, 5):
    raise ImportError(f"transformers {transformers.__version__} is outside the supported range >=4.56,<6")

#: What ``generate`` calls to build the mask when none is passed (the only way to get a 4-D mask in).
GENERATE_MASK_BUILDER = "_prepare_attention_mask_for_generation"


def config_base() -> type:
    """transformers' config base class (renamed ``PreTrainedConfig`` in 5.x)."""
    return transformers.PretrainedConfig if TRANSFORMERS_MAJOR == 4 else transformers.PreTrainedConfig


def cache_kwarg_name() -> str:
    """The model-kwargs key generation (and upstream's kwargs update, via ``ALL_CACHE_NAMES[0]``) uses."""
    return "past_key_values" if TRANSFORMERS_MAJOR == 4 else "cache"


def forward_cache_kwarg(forward: Callable[..., Any]) -> str:
    """The keyword a model's ``forward`` takes its cache under (stock 5.x models: ``cache``; remote code and
    4.x models: ``past_key_values``). Read once per function, as ``takes_write_slots``."""
    return _cache_kwarg(getattr(forward, "__func__", forward))


@functools.lru_cache(maxsize=64)
def _cache_kwarg(function: Callable[..., Any]) -> str:
    params = inspect.signature(function).parameters
    for name in ("past_key_values", "cache"):
        if name in params:
            return name
    raise TypeError(f"{getattr(function, '__qualname__', function)!r} takes neither past_key_values nor cache")


@functools.lru_cache(maxsize=64)
def _takes_cache_position(function: Callable[..., Any]) -> bool:
    return "cache_position" in inspect.signature(function).parameters


def takes_write_slots(forward: Callable[..., Any]) -> bool:
    """Whether ``forward`` takes the static-cache write slots (``cache_position``; see ``write_slot_kwargs``).
    Read once per function: a decode loop asks at every step, and a signature costs more than a tiny forward's op."""
    return _takes_cache_position(getattr(forward, "__func__", forward))


def write_slot_kwargs(forward: Callable[..., Any], slots: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The kwargs that tell a stock model which static-cache slots this forward writes.

    4.x models take ``cache_position`` and, without it, derive the slots from ``get_seq_length()``, which counts
    row 0's non-zero keys: a zero key (a pad token's) makes them write over earlier slots. 5.x models take no
    ``cache_position`` (the cache tracks its own write offset), so nothing is passed there.
    """
    if slots is None or not takes_write_slots(forward):
        return {}
    return {"cache_position": slots}


def remote_code_kwargs(updated: dict[str, Any]) -> dict[str, Any]:
    """HunyuanImage-3's kwargs update stores the cache under ``ALL_CACHE_NAMES``' first hit (``cache`` on 5.x),
    but its ``prepare_inputs_for_generation`` reads ``past_key_values``: carry it over, or every decode step after
    the prefill would run without its cache."""
    name = cache_kwarg_name()
    if name == "past_key_values" or name not in updated:
        return updated
    carried = dict(updated)
    carried["past_key_values"] = carried.pop(name)
    return carried


def lazy_init_arity() -> int:
    """How many tensors ``StaticLayer.lazy_initialization`` takes on this stack."""
    return 1 if TRANSFORMERS_MAJOR == 4 else 2


def lazy_init_layer(layer: Any, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """Allocate a static cache layer's buffers from the first write, with the arity this stack expects."""
    if lazy_init_arity() == 1:
        layer.lazy_initialization(key_states)
    else:
        layer.lazy_initialization(key_states, value_states)


def has_module(name: str) -> bool:
    """True when ``name`` imports on this stack (e.g. ``transformers.modeling_attn_mask_utils``, gone in 5.x)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


#: Modules remote code may import that transformers 5.x removed (both HunyuanImage-3 generations import the first:
#: generation 1's ``hunyuan.py`` and generation 2's ``siglip2.py``).
REMOVED_IN_5 = ("transformers.modeling_attn_mask_utils",)


def removed_module_reason(err: BaseException, code: str = "the checkpoint's remote code") -> str | None:
    """Why a load failed because the code imports a module this stack removed, or None for any other failure
    (walks the exception's causes). ``code`` names what was loaded (e.g. "HunyuanImage-3 generation 2
    (modeling_hunyuan_image_3.py)"), so the refusal names the right generation."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, ModuleNotFoundError) and seen.name in REMOVED_IN_5 and TRANSFORMERS_MAJOR >= 5:
            return (f"{code} imports {seen.name}, which transformers {transformers.__version__} removed: it runs on "
                    "transformers 4.x only (use the lowest lock)")
        seen = seen.__cause__ or seen.__context__
    return None


def generate_accepts_mask(mask: torch.Tensor | None) -> bool:
    """``generate`` rejects any passed mask that is not 2-D (both majors); pass None to get the model's own."""
    return mask is None or mask.dim() == 2


def diffusers_has(name: str) -> bool:
    """True when the installed diffusers exports ``name`` (the MiniMax-H3 VAE needs diffusers >=0.40, which
    needs huggingface-hub >=1.23, which transformers 4.x refuses: no 4.x stack has it)."""
    import diffusers

    return hasattr(diffusers, name)


#: The diffusers class a path's models are built from, where some supported stack lacks it.
PATH_NEEDS_DIFFUSERS: dict[str, str] = {"decode": "AutoencoderKLMiniMaxH3"}


def path_unavailable(path: str) -> str | None:
    """Why ``path`` cannot run on the installed stack (a diffusers class it needs is missing), or None.

    The one test every generated item, decode test and tiny checkpoint asks, in the parent process, so
    a lane without the class skips the path with this reason instead of failing inside a rank.
    """
    needed = PATH_NEEDS_DIFFUSERS.get(path)
    if needed is None:  # diffusers (and the torch._dynamo it imports) loads only for a path that needs it
        return None
    import diffusers

    if diffusers_has(needed):
        return None
    return (f"diffusers {diffusers.__version__} has no {needed} (it needs diffusers >=0.40, whose huggingface-hub "
            f">=1.23 transformers 4.x refuses): the {path} path runs on the latest lock only")


# ------------------------------------------------------------------ weight init for fakes' _init_weights
def _hf_init() -> Any:
    import transformers.initialization as hf_init  # 5.x only

    return hf_init


def init_normal_(tensor: torch.Tensor, std: float) -> None:
    """``normal_(0, std)``, skipping a tensor 5.x marked as loaded."""
    if TRANSFORMERS_MAJOR == 4:
        tensor.normal_(mean=0.0, std=std)
    else:
        _hf_init().normal_(tensor, mean=0.0, std=std)


def init_zeros_(tensor: torch.Tensor) -> None:
    """``zero_()``, skipping a tensor 5.x marked as loaded."""
    if TRANSFORMERS_MAJOR == 4:
        tensor.zero_()
    else:
        _hf_init().zeros_(tensor)


def init_ones_(tensor: torch.Tensor) -> None:
    """``fill_(1)``, skipping a tensor 5.x marked as loaded."""
    if TRANSFORMERS_MAJOR == 4:
        tensor.fill_(1.0)
    else:
        _hf_init().ones_(tensor)


def init_copy_(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """``copy_(value)`` (non-persistent buffers such as RoPE tables are recomputed on every load)."""
    if TRANSFORMERS_MAJOR == 4:
        tensor.copy_(value)
    else:
        _hf_init().copy_(tensor, value)
