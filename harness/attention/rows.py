"""The rows of a capture, each with its own layout, and the contract each is held to.

A capture holds B rows, and rows of one batch need not share a layout: right-padded sequences of different
lengths put each row's image spans elsewhere. So every check of a capture judges it row by row: a row is a capture
of its own (B = 1) with its own keys and layout. Where the recorder stored the layout the model laid the row out
with (``Capture.positions`` / ``spans``), the row's keys are ``[0, its last position + 1)`` and its mask is judged
against those spans: a mask that lost a span, or a cached step whose query rows moved, fails there. A capture
without a recorded layout (the seed's format) has each row's spans read back from its own mask, as the seed's
checks always did.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from harness.attention import contract, masks
from harness.attention.capture import Capture
from harness.attention.layout import AttentionLayout
from harness.judging.compare import Verdict, holds

__all__ = ["CaptureRow", "capture_rows", "formula_problems", "row_contract"]


@dataclass(frozen=True, eq=False)
class CaptureRow:
    """Row ``row`` of a capture as a capture of its own: its query, its keys (``[0, keys)``), its mask there; the
    spans it is judged at (recorded or read back from its mask), the layout they make (None, with ``problem``, when
    they make no structured layout), and how many (query, key) pairs its mask admits past its keys."""

    capture: Capture
    row: int
    source: str
    recorded: bool
    spans: tuple[tuple[int, int], ...]
    positions: tuple[int, ...]
    past_keys: int
    layout: AttentionLayout | None
    problem: str | None

    @property
    def label(self) -> str:
        return f"{self.source} row {self.row}"


def _layout(q_len: int, kv_len: int, spans: tuple[tuple[int, int], ...]) -> tuple[AttentionLayout | None, str | None]:
    try:
        return contract.layout_for(q_len, kv_len, spans[-1] if spans else None, spans[:-1]), None
    except ValueError as err:
        return None, str(err)


def capture_rows(capture: Capture) -> list[CaptureRow]:
    """Every row of ``capture`` as a ``CaptureRow`` (module docstring)."""
    out = []
    for b in range(capture.query.shape[0]):
        if capture.recorded:
            positions = tuple(int(p) for p in capture.positions[b])
            spans = tuple((int(a), int(e)) for a, e in capture.spans[b])
            keys = max(positions) + 1
        else:
            keys = capture.kv_len
            positions = tuple(range(keys - capture.q_len, keys))
            spans = contract.detect_spans(capture.mask[b, 0])
        mask = capture.mask[b:b + 1]
        past = int(mask[..., keys:].sum())
        row = Capture(capture.query[b:b + 1], capture.key[b:b + 1, :keys], capture.value[b:b + 1, :keys],
                      mask[..., :keys].contiguous(), scale=capture.scale, name=f"{capture.name} row {b}")
        layout, problem = _layout(capture.q_len, keys, spans)
        out.append(CaptureRow(row, b, capture.name, capture.recorded, spans, positions, past, layout, problem))
    return out


def formula_problems(row: CaptureRow) -> list[str]:
    """What keeps a row's mask off the contract's formula at its spans, in words ([] when it agrees): query rows
    that are not the last Q of its keys, keys admitted past its last query position, pairs the formula says
    otherwise (the first named by query row, position and key)."""
    capture = row.capture
    q_len, kv_len = capture.q_len, capture.kv_len
    problems = []
    if list(row.positions) != list(range(kv_len - q_len, kv_len)):
        problems.append(f"query rows sit at positions {_runs(row.positions)} ({q_len} rows), not the last {q_len} of "
                        f"the {kv_len} keys the formula aligns them to")
    if row.past_keys:
        problems.append(f"the mask admits {row.past_keys} pairs past the row's last query position {kv_len - 1}")
    spans = row.spans or ((kv_len, kv_len),)  # no span: the formula is plain causal
    expected = contract.formula_mask(q_len, kv_len, spans[-1], images=spans[:-1])
    bad, first = contract.mask_mismatches(capture.mask[0, 0], expected)
    if bad:
        q, k = first
        got = bool(capture.mask[0, 0, q, k])
        problems.append(f"{bad} of {q_len * kv_len} pairs differ; first at query row {q} (position "
                        f"{row.positions[q]}), key {k}: the model's mask says {got}, the formula {not got}")
    return problems


def row_contract(row: CaptureRow) -> Verdict:
    """What a row of a capture must be: its mask the contract's formula at its spans (``formula_problems``), a
    structured layout whose mask the suite's builder reproduces. Every fact names the file and the row."""
    capture, label = row.capture, row.label
    source = "recorded beside it" if row.recorded else "read back from its mask"
    problems = formula_problems(row)
    # what failed is kept under the row's own name: a merge over many rows keeps every row's account
    account = {f"{label} formula": "; ".join(problems)} if problems else {}
    verdict = holds(not problems, f"{label}: its mask is the contract's formula at the spans {source} "
                                  f"{list(row.spans)}", **account)
    if row.layout is None:
        return verdict.require(False, f"{label}: its spans make a structured layout",
                               **{f"{label} layout": row.problem})
    built, first = contract.mask_mismatches(masks.build_mask(row.layout, device=capture.mask.device), capture.mask)
    return verdict.require(built == 0, f"{label}: build_mask({row.layout.describe()}) reproduces its mask",
                           builder_mismatches=built, builder_first_mismatch=str(first))


def _runs(positions: tuple[int, ...]) -> str:
    """Positions as ``a..b`` runs: ``[17..33]`` for a contiguous row, more runs where it is not."""
    runs, start = [], positions[0] if positions else 0
    for prev, nxt in itertools.pairwise(positions):
        if nxt != prev + 1:
            runs.append((start, prev))
            start = nxt
    if positions:
        runs.append((start, positions[-1]))
    return "[" + ", ".join(f"{a}..{b}" if a != b else f"{a}" for a, b in runs) + "]"
