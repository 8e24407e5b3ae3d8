"""The mask contract as the seed states it, and a verifier for any mask or capture.

``formula_mask`` writes the seed's statement ``mask[i, j] = (j <= i) OR (i and j both in [a, b))``
directly (with earlier images: OR both in any one image span), deliberately sharing nothing with
``harness.attention.masks``: it is the oracle the builder and the captured masks are judged against.
Every mask of the structured family gives each query row a prefix of the keys, so the row-visibility
counts locate the spans without knowing the layout.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass

import torch

from harness.attention.layout import AttentionLayout

__all__ = [
    "ContractReport",
    "density",
    "detect_layout",
    "detect_span",
    "detect_spans",
    "formula_mask",
    "layout_for",
    "mask_grid",
    "mask_mismatches",
    "row_visibility",
    "verify_mask",
    "visibility_histogram",
]


def mask_grid(mask: torch.Tensor) -> torch.Tensor:
    """Accept (Q, KV) or a capture's (B, 1, Q, KV) whose batch entries agree; return (Q, KV) bool."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be bool (True = may attend), got {mask.dtype}")
    if mask.dim() == 4:
        if mask.shape[1] != 1:
            raise ValueError(f"a (B, 1, Q, KV) mask must have 1 head-broadcast entry, got shape {tuple(mask.shape)}")
        if mask.shape[0] > 1 and not bool((mask == mask[:1]).all()):
            raise ValueError("the batch entries of the (B, 1, Q, KV) mask differ; verify them one at a time")
        return mask[0, 0]
    if mask.dim() != 2:
        raise ValueError(f"mask must be (Q, KV) or (B, 1, Q, KV), got shape {tuple(mask.shape)}")
    return mask


def formula_mask(q_len: int, kv_len: int, span: tuple[int, int],
                 device: torch.device | str | None = None, *, images: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
    """The seed's contract for Q query rows bottom-right aligned with KV keys, span [a, b) (and any earlier
    image spans, each bidirectional the same way).

    Pure and seam-free, so the last few are cached (28 MB each at the seed's S): treat as read-only.
    """
    spans = tuple((int(a), int(b)) for a, b in (*images, span))
    return _formula_mask(int(q_len), int(kv_len), spans, str(torch.device(device or "cpu")))


@functools.lru_cache(maxsize=4)
def _formula_mask(q_len: int, kv_len: int, spans: tuple[tuple[int, int], ...], device: str) -> torch.Tensor:
    if q_len > kv_len:
        raise ValueError(f"query rows ({q_len}) cannot exceed keys ({kv_len}): queries are a suffix of the keys")
    i = torch.arange(kv_len - q_len, kv_len, device=device)
    j = torch.arange(kv_len, device=device)
    mask = j[None, :] <= i[:, None]
    for a, b in spans:
        mask = mask | (((i >= a) & (i < b))[:, None] & ((j >= a) & (j < b))[None, :])
    return mask


def row_visibility(mask: torch.Tensor) -> torch.Tensor:
    """How many keys each query row may attend to (int32; a byte view sums twice as fast as bool)."""
    return mask_grid(mask).contiguous().view(torch.uint8).sum(dim=-1, dtype=torch.int32)


def density(mask: torch.Tensor) -> float:
    grid = mask_grid(mask)
    return _density(row_visibility(grid), grid.numel())


def _density(counts: torch.Tensor, total: int) -> float:
    return float(counts.sum(dtype=torch.float64)) / max(1, total)


def visibility_histogram(mask: torch.Tensor) -> dict[int, int]:
    """{visible keys: number of rows}, sorted by the count of visible keys."""
    return _histogram(row_visibility(mask))


def _histogram(counts: torch.Tensor) -> dict[int, int]:
    tally = Counter(counts.tolist())
    return {int(k): int(tally[k]) for k in sorted(tally)}


def detect_span(mask: torch.Tensor) -> tuple[int, int] | None:
    """The (generated) image span [a, b) of a structured mask: the last of its spans, or None when every row is
    purely causal (see ``detect_spans``)."""
    spans = detect_spans(mask)
    return spans[-1] if spans else None


def detect_spans(mask: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """Every bidirectional span [a, b) of a structured mask, in order.

    A span row at position i sees the prefix [0, b), more than the causal i + 1: each run of such rows
    sharing one count b starts at a. (A one-token span is indistinguishable from causal.)
    """
    grid = mask_grid(mask)
    return _spans_from_counts(row_visibility(grid), grid.shape[1])


def _spans_from_counts(counts: torch.Tensor, kv_len: int) -> tuple[tuple[int, int], ...]:
    q_len = counts.shape[0]
    pos = torch.arange(kv_len - q_len, kv_len, device=counts.device)
    wider = (counts > pos + 1).nonzero().flatten().tolist()
    spans: list[tuple[int, int]] = []
    previous = None
    for row in wider:
        count = int(counts[row])
        if previous is None or row != previous + 1 or count != spans[-1][1]:
            spans.append((int(pos[row]), count))
        previous = row
    return tuple(spans)


def detect_layout(mask: torch.Tensor) -> AttentionLayout:
    """The layout whose formula a structured mask follows (prefill when Q == KV, else denoise)."""
    grid = mask_grid(mask)
    q_len, kv_len = grid.shape
    if q_len > kv_len:
        raise ValueError(f"mask has more query rows ({q_len}) than keys ({kv_len}); expected Q <= KV")
    *images, span = detect_spans(grid) or (None,)
    return layout_for(q_len, kv_len, span, tuple(images))


def layout_for(q_len: int, kv_len: int, span: tuple[int, int] | None,
               images: tuple[tuple[int, int], ...] = ()) -> AttentionLayout:
    """The layout of a Q x KV mask whose detected span is ``span`` and earlier image spans ``images``
    (see ``detect_layout``)."""
    if q_len > kv_len:
        raise ValueError(f"mask has more query rows ({q_len}) than keys ({kv_len}); expected Q <= KV")
    if span is None:
        raise ValueError(f"mask {q_len} x {kv_len} has no image span (every row sees only its causal prefix); "
                         "the structured layout needs a span of >= 2 tokens")
    a, b = span
    if b > kv_len or a >= b:
        raise ValueError(f"detected span [{a}, {b}) does not fit {kv_len} keys")
    if q_len == kv_len:
        return AttentionLayout(a, b - a, kv_len - b, "prefill", images)
    offset = kv_len - q_len
    if b != kv_len:
        raise ValueError(f"denoise mask ({q_len} x {kv_len}) has keys past the span end {b}; "
                         "denoise keys must end at the span end")
    if a < offset:
        raise ValueError(f"denoise mask ({q_len} x {kv_len}): span start {a} lies before query row 0 "
                         f"(position {offset}); expected special rows then the image span")
    return AttentionLayout(a, b - a, a - offset, "denoise", images)


@dataclass(frozen=True)
class ContractReport:
    """What the verifier found: agreement with the formula, density, histogram, span."""

    q_len: int
    kv_len: int
    span: tuple[int, int] | None
    detected_span: tuple[int, int] | None
    mismatches: int
    first_mismatch: tuple[int, int] | None
    density: float
    histogram: dict[int, int]
    detected_images: tuple[tuple[int, int], ...] = ()  # spans detected before ``detected_span``

    @property
    def total(self) -> int:
        return self.q_len * self.kv_len

    def where(self) -> str:
        if self.first_mismatch is None:
            return "no mismatch"
        row, key = self.first_mismatch
        return f"first mismatch at query row {row}, key {key}"


def mask_mismatches(actual: torch.Tensor, expected: torch.Tensor) -> tuple[int, tuple[int, int] | None]:
    """(elements that differ, (query row, key) of the first one) between two (Q, KV) masks."""
    actual, expected = mask_grid(actual), mask_grid(expected)
    if actual.shape != expected.shape:
        raise ValueError(f"mask shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    if torch.equal(actual, expected):
        return 0, None
    diff = actual != expected
    at = diff.nonzero()[0]
    return int(diff.sum()), (int(at[0]), int(at[1]))


def verify_mask(mask: torch.Tensor, span: tuple[int, int] | None = None, *,
                images: tuple[tuple[int, int], ...] = ()) -> ContractReport:
    """Check ``mask`` against the formula at ``span`` with the earlier image spans ``images`` (default: the spans
    detected in the mask, earlier images included)."""
    grid = mask_grid(mask)
    q_len, kv_len = grid.shape
    counts = row_visibility(grid)
    spans = _spans_from_counts(counts, kv_len)
    detected = spans[-1] if spans else None
    images = spans[:-1] if span is None else tuple(images)
    use = span if span is not None else detected
    if use is None:
        use = (kv_len, kv_len)  # no span: the formula is plain causal
    bad, first = mask_mismatches(grid, formula_mask(q_len, kv_len, use, device=grid.device, images=images))
    return ContractReport(q_len, kv_len, span, detected, bad, first, _density(counts, grid.numel()),
                          _histogram(counts), images)
