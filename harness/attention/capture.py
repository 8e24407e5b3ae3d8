"""Attention captures in the seed's npz format, and a deterministic synthetic one at the seed's shapes.

A capture file holds ``query`` (B, Sq, H, D), ``key`` and ``value`` (B, Skv, Hkv, D) float32 and
``mask`` (B, 1, Q, KV) bool (True = may attend), named ``call<N>_rank<R>.npz``. Real dumps store
bf16 activations converted to float32, so the synthetic generator rounds through bf16 the same way.
Its mask comes from the contract's formula (the model's ground truth), never from the builder under
test.
"""

from __future__ import annotations

import re
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from harness.attention.contract import formula_mask
from harness.attention.layout import SEED_HEAD_DIM, SEED_HEADS, SEED_SCALE, AttentionLayout
from harness.checkpoints import CAPTURE_GLOB, SHIPPED_KINDS

__all__ = [
    "CAPTURE_ARRAYS",
    "CAPTURE_GLOB",
    "CAPTURE_KIND",
    "SEED_CALLS",
    "Capture",
    "capture_name",
    "find_captures",
    "load_capture",
    "peek_shapes",
    "phase_capture_path",
    "save_capture",
    "synthetic_capture",
]

CAPTURE_ARRAYS = ("query", "key", "value", "mask")
SEED_CALLS = {"prefill": 0, "denoise": 32}  # call0 is the prefill pass, call32 a denoise pass
_NAME = re.compile(r"^call(\d+)_rank(\d+)\.npz$")
# A directory of capture files feeds the attention path (matched on file names, not a model config). The
# very object harness.checkpoints ships, so either entry point may register it first (same object: idempotent).
CAPTURE_KIND = next(kind for kind in SHIPPED_KINDS if kind.feeds == "attention")


@dataclass(frozen=True, eq=False)
class Capture:
    """q/k/v in the capture's (B, S, H, D) layout plus the (B, 1, Q, KV) mask."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor
    scale: float = SEED_SCALE
    name: str = "synthetic"

    def __post_init__(self) -> None:
        for field_name in ("query", "key", "value"):
            t = getattr(self, field_name)
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"capture {self.name}: {field_name} must be a (B, S, H, D) tensor, "
                                 f"got {getattr(t, 'shape', type(t).__name__)}")
            if not t.is_floating_point():
                raise TypeError(f"capture {self.name}: {field_name} must be floating point, got {t.dtype}")
        q, k, v, m = self.query, self.key, self.value, self.mask
        if k.shape != v.shape:
            raise ValueError(f"capture {self.name}: key {tuple(k.shape)} and value {tuple(v.shape)} differ")
        if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
            raise ValueError(f"capture {self.name}: query {tuple(q.shape)} and key {tuple(k.shape)} must share "
                             "batch and head dim")
        if q.shape[2] % k.shape[2]:
            raise ValueError(f"capture {self.name}: {q.shape[2]} query heads are not a multiple of "
                             f"{k.shape[2]} key/value heads")
        expected = (q.shape[0], 1, q.shape[1], k.shape[1])
        if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or tuple(m.shape) != expected:
            raise ValueError(f"capture {self.name}: mask must be bool of shape (B, 1, Q, KV) = {expected}, got "
                             f"{getattr(m, 'dtype', type(m).__name__)} {tuple(getattr(m, 'shape', ()))}")

    @property
    def q_len(self) -> int:
        return self.query.shape[1]

    @property
    def kv_len(self) -> int:
        return self.key.shape[1]

    @property
    def heads(self) -> int:
        return self.query.shape[2]

    @property
    def kv_heads(self) -> int:
        return self.key.shape[2]

    @property
    def phase(self) -> str:
        return "prefill" if self.q_len == self.kv_len else "denoise"

    def heads_first(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, S, H, D) -> (B, H, S, D), the layout SDPA, flex and flash-style kernels take."""
        return tuple(t.transpose(1, 2).contiguous() for t in (self.query, self.key, self.value))

    def select_heads(self, heads: int) -> Capture:
        """The first ``heads`` query heads with the key/value heads their GQA groups use."""
        group = self.heads // self.kv_heads
        if not 1 <= heads <= self.heads or heads % group:
            raise ValueError(f"capture {self.name}: cannot keep {heads} of {self.heads} query heads "
                             f"(must be 1..{self.heads} and a multiple of the GQA group {group})")
        kv = heads // group
        return replace(self, query=self.query[:, :, :heads], key=self.key[:, :, :kv], value=self.value[:, :, :kv])

    def to(self, device: torch.device | str) -> Capture:
        return replace(self, query=self.query.to(device), key=self.key.to(device), value=self.value.to(device),
                       mask=self.mask.to(device))


def capture_name(call: int, rank: int = 0) -> str:
    return f"call{call}_rank{rank}.npz"


def save_capture(capture: Capture, path: str | Path) -> Path:
    """Write the seed's npz format (uncompressed, float32 q/k/v, bool mask)."""
    path = Path(path)
    arrays = {name: getattr(capture, name).detach().cpu().contiguous() for name in CAPTURE_ARRAYS}
    arrays = {name: (t.float() if name != "mask" else t).numpy() for name, t in arrays.items()}
    with path.open("wb") as fh:
        np.savez(fh, **arrays)
    return path


def load_capture(path: str | Path, scale: float = SEED_SCALE) -> Capture:
    """Read a capture file, naming the file and the array whenever it does not fit the format."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"capture file {path} does not exist")
    with np.load(path, allow_pickle=False) as z:
        missing = [name for name in CAPTURE_ARRAYS if name not in z.files]
        if missing:
            raise ValueError(f"capture {path.name}: missing arrays {missing}; the format holds {list(CAPTURE_ARRAYS)}")
        arrays = {name: z[name] for name in CAPTURE_ARRAYS}
    for name in ("query", "key", "value"):
        if arrays[name].dtype != np.float32:
            raise TypeError(f"capture {path.name}: {name} must be float32, got {arrays[name].dtype}")
    if arrays["mask"].dtype != np.bool_:
        raise TypeError(f"capture {path.name}: mask must be bool (True = may attend), got {arrays['mask'].dtype}")
    tensors = {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}
    return Capture(**tensors, scale=scale, name=path.name)


def peek_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Array shapes of a capture file read from the npy headers only (no data loaded)."""
    shapes = {}
    with zipfile.ZipFile(path) as zf:
        for member in zf.namelist():
            with zf.open(member) as fh:
                version = np.lib.format.read_magic(fh)
                read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                        else np.lib.format.read_array_header_2_0)
                shape, _, _ = read(fh)
            shapes[member.removesuffix(".npy")] = tuple(shape)
    return shapes


def find_captures(directory: str | Path) -> list[Path]:
    """The ``call<N>_rank<R>.npz`` files of a capture directory, ordered by (call, rank)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"capture directory {directory} does not exist")
    found = [(int(m[1]), int(m[2]), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    if not found:
        raise ValueError(f"capture directory {directory} holds no call<N>_rank<R>.npz files")
    return [p for _, _, p in sorted(found)]


def phase_capture_path(directory: str | Path, phase: str, rank: int = 0) -> Path:
    """The seed's file for ``phase`` when present, else the first file of that phase (Q == KV: prefill)."""
    seed = Path(directory) / capture_name(SEED_CALLS[phase], rank)
    if seed.is_file():
        return seed
    for path in find_captures(directory):
        shape = peek_shapes(path).get("mask")
        if shape is not None and len(shape) == 4 and (shape[2] == shape[3]) == (phase == "prefill"):
            return path
    raise ValueError(f"capture directory {directory} holds no {phase} capture (mask with Q "
                     f"{'==' if phase == 'prefill' else '<'} KV)")


def synthetic_capture(layout: AttentionLayout, *, heads: int = SEED_HEADS, kv_heads: int | None = None,
                      head_dim: int = SEED_HEAD_DIM, batch: int = 1, seed: int = 0) -> Capture:
    """A deterministic capture of ``layout``: seeded bf16-rounded normal q/k/v, the formula's mask."""
    kv_heads = heads if kv_heads is None else kv_heads
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a positive multiple of kv_heads ({kv_heads})")
    gen = torch.Generator().manual_seed(seed)

    def normal(rows: int, n_heads: int) -> torch.Tensor:
        return torch.randn(batch, rows, n_heads, head_dim, generator=gen).to(torch.bfloat16).float()

    query = normal(layout.q_len, heads)
    key = normal(layout.kv_len, kv_heads)
    value = normal(layout.kv_len, kv_heads)
    mask = formula_mask(layout.q_len, layout.kv_len, layout.span, images=layout.images)[None, None].repeat(
        batch, 1, 1, 1)  # own copy
    name = f"synthetic_{capture_name(SEED_CALLS.get(layout.phase, 0))}"
    return Capture(query, key, value, mask, scale=head_dim ** -0.5, name=name)
