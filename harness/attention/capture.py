"""Attention captures in the seed's npz format, and a deterministic synthetic one at the seed's shapes.

A capture file holds ``query`` (B, Sq, H, D), ``key`` and ``value`` (B, Skv, Hkv, D) float32 and
``mask`` (B, 1, Q, KV) bool (True = may attend), named ``call<N>_rank<R>.npz``. Real dumps store
bf16 activations converted to float32, so the synthetic generator rounds through bf16 the same way.
Its mask comes from the contract's formula (the model's ground truth), never from the builder under
test.

A recorder that knows how the model laid each row out stores it beside the arrays (``LAYOUT_ARRAYS``, both or
neither): ``positions`` (B, Q) integers, the absolute position of each query row, and ``spans`` (B, N, 2) integers,
each row's image spans ``[a, b)`` in order, the generated image's last. A row's keys are then ``[0, last position
+ 1)``; the checks judge its mask against these spans (harness.attention.rows), never against spans read back from
the mask itself, which a mask that lost a span would agree with.

Capture files are untrusted data: they are read with ``allow_pickle=False`` only, and anything that is
not an npz archive of the four plain arrays (garbage, a truncated or corrupted archive, object arrays)
is a ValueError naming the file, never advice to load it another way. ``validate_directory`` checks every
file of a directory, headers and data, so a run stops on a bad file before any check.
"""

from __future__ import annotations

import io
import re
import zipfile
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from harness.attention.contract import formula_mask
from harness.attention.layout import SEED_HEAD_DIM, SEED_HEADS, SEED_SCALE, AttentionLayout
from harness.inputs.checkpoints import CAPTURE_GLOB, SHIPPED_KINDS, not_a_file

__all__ = [
    "CAPTURE_ARRAYS",
    "CAPTURE_GLOB",
    "CAPTURE_KIND",
    "LAYOUT_ARRAYS",
    "SEED_CALLS",
    "Capture",
    "capture_name",
    "check_layout_shapes",
    "check_layout_values",
    "check_shapes",
    "find_captures",
    "load_capture",
    "not_a_file",
    "peek_shapes",
    "phase_capture_path",
    "phase_captures",
    "save_capture",
    "synthetic_capture",
    "validate_directory",
    "validate_file",
]

CAPTURE_ARRAYS = ("query", "key", "value", "mask")
LAYOUT_ARRAYS = ("positions", "spans")  # optional, together: each row's layout as the model laid it out
SEED_CALLS = {"prefill": 0, "denoise": 32}  # call0 is the prefill pass, call32 a denoise pass
_NAME = re.compile(r"^call(\d+)_rank(\d+)\.npz$")
# A directory of capture files feeds the attention path (matched on file names, not a model config). The
# very object harness.inputs.checkpoints ships, so either entry point may register it first (same object: idempotent).
CAPTURE_KIND = next(kind for kind in SHIPPED_KINDS if kind.feeds == "attention")


@dataclass(frozen=True, eq=False)
class Capture:
    """q/k/v in the capture's (B, S, H, D) layout plus the (B, 1, Q, KV) mask; with the layout the model recorded,
    each row's query ``positions`` (B, Q) and image ``spans`` (B, N, 2) (module docstring)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor
    scale: float = SEED_SCALE
    name: str = "synthetic"
    positions: torch.Tensor | None = None
    spans: torch.Tensor | None = None

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
        if 0 in (*q.shape, *k.shape):
            raise ValueError(f"capture {self.name}: query {tuple(q.shape)} and key {tuple(k.shape)} hold no attention "
                             "to compare (every dimension must be at least 1)")
        if q.shape[2] % k.shape[2]:
            raise ValueError(f"capture {self.name}: {q.shape[2]} query heads are not a multiple of "
                             f"{k.shape[2]} key/value heads")
        expected = (q.shape[0], 1, q.shape[1], k.shape[1])
        if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or tuple(m.shape) != expected:
            raise ValueError(f"capture {self.name}: mask must be bool of shape (B, 1, Q, KV) = {expected}, got "
                             f"{getattr(m, 'dtype', type(m).__name__)} {tuple(getattr(m, 'shape', ()))}")
        if (self.positions is None) != (self.spans is None):
            raise ValueError(f"capture {self.name}: a recorded layout holds both {list(LAYOUT_ARRAYS)}, or neither")
        if self.positions is not None:
            for name, t in (("positions", self.positions), ("spans", self.spans)):
                if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                    raise TypeError(f"capture {self.name}: {name} must be an integer tensor, got "
                                    f"{getattr(t, 'dtype', type(t).__name__)}")
            check_layout_shapes(self.name, tuple(q.shape), tuple(k.shape), tuple(self.positions.shape),
                                tuple(self.spans.shape))
            check_layout_values(self.name, self.positions, self.spans, k.shape[1])

    @property
    def recorded(self) -> bool:
        """Whether the recorder stored each row's layout beside the arrays."""
        return self.positions is not None

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
    """Write the seed's npz format (uncompressed, float32 q/k/v, bool mask; int64 positions and spans when the
    capture holds its recorded layout)."""
    path = Path(path)
    arrays = {name: getattr(capture, name).detach().cpu().contiguous() for name in CAPTURE_ARRAYS}
    arrays = {name: (t.float() if name != "mask" else t).numpy() for name, t in arrays.items()}
    if capture.recorded:
        arrays.update({name: getattr(capture, name).detach().cpu().to(torch.int64).contiguous().numpy()
                       for name in LAYOUT_ARRAYS})
    with path.open("wb") as fh:
        np.savez(fh, **arrays)
    return path


class _Unreadable(ValueError):
    """A capture file that is not an npz archive of plain arrays."""


def _unreadable(path: Path, what: str) -> _Unreadable:
    return _Unreadable(f"capture file {path}: {what}; expected an npz archive (numpy.savez) of plain arrays "
                       f"{list(CAPTURE_ARRAYS)}")


# what reading a damaged archive may raise: a bad or truncated zip, a short or corrupted member, a bad npy header
_READ_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, KeyError, SyntaxError,
                NotImplementedError)


# how np.load tells an npz archive: a local file header first, or the end record of an empty archive
_ZIP_STARTS = (b"PK\x03\x04", b"PK\x05\x06")


def _open_archive(path: Path) -> zipfile.ZipFile:
    if not path.is_file():
        raise ValueError(f"capture file {not_a_file(path, 'an npz archive')}")
    if not zipfile.is_zipfile(path):  # never handed to np.load, which would offer to unpickle it
        raise _unreadable(path, "not an npz archive (no zip directory: garbage, or truncated)")
    with path.open("rb") as fh:
        start = fh.read(4)
    if start not in _ZIP_STARTS:  # zipfile reads past leading bytes; np.load takes them for a pickle or a bare array
        raise _unreadable(path, "not an npz archive (other data precedes its zip records)")
    try:
        return zipfile.ZipFile(path)
    except _READ_ERRORS as err:
        raise _unreadable(path, f"a damaged zip archive ({type(err).__name__}: {err})") from None


def load_capture(path: str | Path, scale: float = SEED_SCALE) -> Capture:
    """Read a capture file, naming the file and the array whenever it does not fit the format."""
    path = Path(path)
    with _open_archive(path) as archive:
        _headers(path, archive)  # every member's size agrees with its npy header before numpy reads its data
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [name for name in CAPTURE_ARRAYS if name not in z.files]
            if missing:
                raise ValueError(f"capture {path.name}: missing arrays {missing}; the format holds "
                                 f"{list(CAPTURE_ARRAYS)}")
            arrays = {name: z[name] for name in (*CAPTURE_ARRAYS, *LAYOUT_ARRAYS) if name in z.files}
    except _Unreadable:
        raise
    except ValueError as err:
        if str(err).startswith(f"capture {path.name}:"):
            raise
        raise _unreadable(path, _numpy_reason(err)) from None
    except _READ_ERRORS as err:
        raise _unreadable(path, f"a damaged archive member ({type(err).__name__}: {err})") from None
    for name in ("query", "key", "value"):
        if arrays[name].dtype != np.float32:
            raise TypeError(f"capture {path.name}: {name} must be float32, got {arrays[name].dtype}")
    if arrays["mask"].dtype != np.bool_:
        raise TypeError(f"capture {path.name}: mask must be bool (True = may attend), got {arrays['mask'].dtype}")
    for name in LAYOUT_ARRAYS:
        if name in arrays and not np.issubdtype(arrays[name].dtype, np.integer):
            raise TypeError(f"capture {path.name}: {name} must be integers, got {arrays[name].dtype}")
    tensors = {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}
    tensors.update({name: tensors[name].to(torch.int64) for name in LAYOUT_ARRAYS if name in tensors})
    return Capture(**tensors, scale=scale, name=path.name)


def _numpy_reason(err: Exception) -> str:
    """numpy's refusal in our words: its first line. It is never a pickle refusal (with advice to allow pickles):
    numpy gets only files that start with a zip record (``_open_archive``), whose members hold no object dtype
    (``_headers``), so it never meets a pickle."""
    text = str(err)
    return f"a damaged array ({type(err).__name__}: {text.splitlines()[0] if text else ''})"


def _headers(path: Path, archive: zipfile.ZipFile) -> dict[str, tuple[tuple[int, ...], np.dtype, int]]:
    """member name -> (shape, dtype, bytes its data takes) from each npy header; no array data is read."""
    found = {}
    for info in archive.infolist():
        try:
            with archive.open(info) as fh:
                version = np.lib.format.read_magic(fh)
                read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                        else np.lib.format.read_array_header_2_0)
                shape, _, dtype = read(fh)
                header_bytes = fh.tell()
        except zipfile.BadZipFile as err:  # a small member is read whole, so its CRC is checked here already
            raise _unreadable(path, f"member {info.filename!r} is damaged ({err})") from None
        except _READ_ERRORS as err:
            raise _unreadable(path, f"member {info.filename!r} is not a numpy array "
                                    f"({type(err).__name__}: {err})") from None
        if dtype.hasobject:
            raise _unreadable(path, f"member {info.filename!r} holds object (pickled) data, which is never loaded")
        expected = header_bytes + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if info.file_size != expected:
            raise _unreadable(path, f"member {info.filename!r} holds {info.file_size} bytes where its header "
                                    f"declares {expected} (truncated or padded)")
        found[info.filename.removesuffix(".npy")] = (tuple(shape), dtype, expected)
    return found


def validate_file(path: str | Path) -> None:
    """Check one capture file against the format from its headers, and every member's data (CRC and length).

    Raises ValueError naming the file and what is wrong.
    """
    path = Path(path)
    with _open_archive(path) as archive:
        headers = _headers(path, archive)
        missing = [name for name in CAPTURE_ARRAYS if name not in headers]
        if missing:
            raise ValueError(f"capture {path}: missing arrays {missing}; the format holds {list(CAPTURE_ARRAYS)}")
        for name in ("query", "key", "value"):
            if headers[name][1] != np.float32:
                raise ValueError(f"capture {path}: {name} must be float32, got {headers[name][1]}")
        if headers["mask"][1] != np.bool_:
            raise ValueError(f"capture {path}: mask must be bool (True = may attend), got {headers['mask'][1]}")
        shapes = {name: headers[name][0] for name in CAPTURE_ARRAYS}
        check_shapes(str(path), shapes)
        layout = [name for name in LAYOUT_ARRAYS if name in headers]
        if layout:
            if len(layout) != len(LAYOUT_ARRAYS):
                raise ValueError(f"capture {path}: a recorded layout holds both {list(LAYOUT_ARRAYS)}, or neither; "
                                 f"it holds {layout} only")
            for name in LAYOUT_ARRAYS:
                if not np.issubdtype(headers[name][1], np.integer):
                    raise ValueError(f"capture {path}: {name} must be integers, got {headers[name][1]}")
            check_layout_shapes(str(path), shapes["query"], shapes["key"], headers["positions"][0],
                                headers["spans"][0])
        for info in archive.infolist():
            _check_data(path, archive, info)
    check_values(path)


def check_values(path: Path) -> None:
    """Data that parses but cannot be attention: a NaN or infinite q/k/v, or a query row whose mask admits no key
    (its softmax is 0/0). Named with the file, the array and the first bad position, before any check runs."""
    with np.load(path, allow_pickle=False) as z:
        for name in ("query", "key", "value"):
            array = z[name]
            finite = np.isfinite(array)
            if not finite.all():  # the first bad position is looked for only in a bad array
                at = tuple(int(i) for i in np.argwhere(~finite)[0])
                kind = "NaN" if np.isnan(array[at]) else "an infinite value"
                raise ValueError(f"capture {path}: array {name!r} holds {kind} at (batch, seq, head, dim) = {at}; "
                                 "a capture holds finite q, k and v")
        admits = z["mask"].any(axis=-1)
        if not admits.all():
            batch, _, row = (int(i) for i in np.argwhere(~admits)[0])
            raise ValueError(f"capture {path}: mask row {row} of batch {batch} admits no key (all False); every "
                             "query must see at least one key")
        if "positions" in z.files:
            check_layout_values(str(path), torch.from_numpy(z["positions"].astype(np.int64)),
                                torch.from_numpy(z["spans"].astype(np.int64)), int(z["key"].shape[1]))


def check_layout_shapes(name: str, query: tuple[int, ...], key: tuple[int, ...], positions: tuple[int, ...],
                        spans: tuple[int, ...]) -> None:
    """A recorded layout's shapes: ``positions`` (B, Q), ``spans`` (B, N, 2) with at least one span per row."""
    if tuple(positions) != (query[0], query[1]):
        raise ValueError(f"capture {name}: positions must be (B, Q) = {(query[0], query[1])}, got {tuple(positions)}")
    if len(spans) != 3 or spans[0] != query[0] or spans[1] < 1 or spans[2] != 2:
        raise ValueError(f"capture {name}: spans must be (B, N, 2) with B = {query[0]} and N >= 1 (each row's image "
                         f"spans, the generated image's last), got {tuple(spans)}")


def check_layout_values(name: str, positions: torch.Tensor, spans: torch.Tensor, keys: int) -> None:
    """A recorded layout's values: every position a key of the capture, every span ``0 <= a < b <= KV``."""
    bad = (positions < 0) | (positions >= keys)
    if bool(bad.any()):
        row, query = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"capture {name}: positions[{row}, {query}] = {int(positions[row, query])} is no key "
                         f"position of its {keys} keys")
    a, b = spans[..., 0], spans[..., 1]
    bad = (a < 0) | (b <= a) | (b > keys)
    if bool(bad.any()):
        row, span = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"capture {name}: spans[{row}, {span}] = [{int(a[row, span])}, {int(b[row, span])}) is no "
                         f"span of its {keys} keys (0 <= a < b <= KV)")


def _check_data(path: Path, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> None:
    """Read one member whole: its CRC (zipfile checks it at the end) and its length, which zipfile does not check
    against the size the archive declares (the size ``_headers`` compared with the npy header)."""
    try:
        with archive.open(info) as fh:
            size = sum(len(block) for block in iter(lambda: fh.read(io.DEFAULT_BUFFER_SIZE), b""))
    except zipfile.BadZipFile as err:
        raise _unreadable(path, f"member {info.filename!r} is damaged ({err})") from None
    except _READ_ERRORS as err:
        raise _unreadable(path, f"a damaged archive ({type(err).__name__}: {err})") from None
    if size != info.file_size:
        raise _unreadable(path, f"member {info.filename!r} holds {size} bytes of data where the archive declares "
                                f"{info.file_size} (truncated or padded)")


def check_shapes(name: str, shapes: dict[str, tuple[int, ...]]) -> None:
    """The format's shape rules on shapes alone (a file's headers; Capture checks the same on its tensors)."""
    q, k, v, m = (tuple(shapes[n]) for n in CAPTURE_ARRAYS)
    for array, shape in (("query", q), ("key", k), ("value", v)):
        if len(shape) != 4:
            raise ValueError(f"capture {name}: {array} must be a (B, S, H, D) tensor, got shape {shape}")
    if k != v:
        raise ValueError(f"capture {name}: key {k} and value {v} differ")
    if q[0] != k[0] or q[3] != k[3]:
        raise ValueError(f"capture {name}: query {q} and key {k} must share batch and head dim")
    if 0 in (*q, *k):
        raise ValueError(f"capture {name}: query {q} and key {k} hold no attention to compare (every dimension must "
                         "be at least 1)")
    if q[2] % k[2]:
        raise ValueError(f"capture {name}: {q[2]} query heads are not a multiple of {k[2]} key/value heads")
    expected = (q[0], 1, q[1], k[1])
    if m != expected:
        raise ValueError(f"capture {name}: mask must be bool of shape (B, 1, Q, KV) = {expected}, got {m}")


def validate_directory(directory: str | Path) -> None:
    """Every capture file of ``directory`` checked from its headers and byte for byte, and one capture per phase
    present: a ValueError naming the first bad file, before anything runs on them (the checks judge every file)."""
    for path in find_captures(directory):
        validate_file(path)
    for phase in SEED_CALLS:
        phase_capture_path(directory, phase)


def phase_captures(directory: str | Path, phase: str) -> list[Path]:
    """Every capture file of ``phase`` in ``directory`` (Q == KV: prefill), ordered by (call, rank): the checks of a
    phase judge each one. A ValueError when there is none."""
    found = [path for path in find_captures(directory) if _phase_of(path) == phase]
    if not found:
        raise ValueError(f"capture directory {directory} holds no {phase} capture (mask with Q "
                         f"{'==' if phase == 'prefill' else '<'} KV)")
    return found


def _phase_of(path: Path) -> str | None:
    shape = peek_shapes(path).get("mask")
    if shape is None or len(shape) != 4:
        return None
    return "prefill" if shape[2] == shape[3] else "denoise"


def peek_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Array shapes of a capture file read from the npy headers only (no data loaded)."""
    path = Path(path)
    with _open_archive(path) as archive:
        return {name: shape for name, (shape, _, _) in _headers(path, archive).items()}


def find_captures(directory: str | Path) -> list[Path]:
    """The ``call<N>_rank<R>.npz`` files of a capture directory, ordered by (call, rank)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"capture directory {not_a_file(directory, 'a directory of capture files')}")
    found = [(int(m[1]), int(m[2]), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    if not found:
        raise ValueError(f"capture directory {directory} holds no call<N>_rank<R>.npz files")
    return [p for _, _, p in sorted(found)]


def phase_capture_path(directory: str | Path, phase: str, rank: int = 0) -> Path:
    """The seed's file for ``phase`` when present, else the first file of that phase (Q == KV: prefill)."""
    seed = Path(directory) / capture_name(SEED_CALLS[phase], rank)
    if seed.is_file():
        return seed
    return phase_captures(directory, phase)[0]


def synthetic_capture(layout: AttentionLayout, *, heads: int = SEED_HEADS, kv_heads: int | None = None,
                      head_dim: int = SEED_HEAD_DIM, batch: int = 1, seed: int) -> Capture:
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
